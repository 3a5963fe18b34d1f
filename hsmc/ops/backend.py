"""The kernels a forward runs with, behind one small interface (mini-sglang's attention backend,
widened to the Linears and the memory-bound steps around them).

A model hands its backend the residual stream and the modules, so the backend decides what to fuse: a
Linear with the RMSNorm before it (`norm_linear`), with SiLU·mul before it (`silu_linear`) and with the
residual add after it (`residual=`, which the backend may add into in place: a caller hands over a residual it
no longer needs); the q/k norm + RoPE + KV write that turns a fused qkv projection
into a query; paged attention. A `linear` module is an `nn.Linear` (or `FusedLinear`) or an FP8
`Fp8Linear`; calling it is the reference matmul. `TorchBackend` is the reference: plain torch, any
device, the CPU oracle, differentiable; the Triton backend (`hsmc.ops.triton_backend`) must match it.
`prepare` runs once per forward and, like everything here, only enqueues device work, so a whole forward
can be captured in a CUDA graph.

The same interface carries the small device steps around a forward that a graphed step runs many times: a
forward's pending tokens and a step's appended tokens (`TokenRows`), KV slots appended and rolled back
(`BlockTables`), a Gumbel-max draw and a scaled logsumexp over the vocabulary (the sampler, the SMC weights), a draft
tree's children and its walk.
Their owners hold the stack's backend, so no caller picks a kernel by device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from hsmc.ops.batch import ForwardBatch, padded_columns
from hsmc.ops.counter_hash import gumbel, keys_of_draws
from hsmc.ops.kv_cache import KVCache
from hsmc.speculative.tree_verify import verify_tree, verify_tree_traversal

if TYPE_CHECKING:
    from hsmc.engine.kv_pool import BlockTables

# what a misuse of the KV slots raises (torch._assert_async: at once on the CPU, without a sync on the GPU)
OUT_OF_SLOTS = "KV pool out of slots: raise engine.kv_capacity_tokens"
ROW_OVERFLOW = "row longer than its block table (engine.kv_capacity_tokens)"
BAD_ROLLBACK = "bad rollback count"
OVER_RELEASED = "KV slot released more often than it was referenced"


@dataclass(frozen=True)
class Rope:
    """A model's rotary embedding: inverse frequencies (fp32) and the attention scaling of its rope type."""

    inv_freq: torch.Tensor
    scale: float


@dataclass(frozen=True)
class HeadLayout:
    """How a fused qkv projection splits: [q heads | k heads | v heads], each `head_dim` wide."""

    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def sizes(self) -> tuple[int, int, int]:
        return self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim


class RMSNormWeight(Protocol):
    """What a norm module holds: its weight and epsilon."""

    weight: torch.Tensor
    eps: float


class Backend(Protocol):
    name: str

    def prepare(self, batch: ForwardBatch, rope: Rope, dtype: torch.dtype) -> Any:
        """Per-forward metadata shared by every layer (masks, rotary tables, split plans)."""
        ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def linear(self, x: torch.Tensor, linear: nn.Module, residual: torch.Tensor | None = None) -> torch.Tensor:
        """[residual +] linear(x): a residual makes the next stream (after o_proj and down_proj). The residual is
        consumed: the result may be that tensor, added into in place (no copy of it before a GEMM)."""
        ...

    def norm_linear(self, stream: torch.Tensor, norm: RMSNormWeight, linear: nn.Module) -> torch.Tensor:
        """linear(rms_norm(stream)): the norm before q/k/v, gate/up and the LM head."""
        ...

    def silu_linear(
        self, gate_up: torch.Tensor, linear: nn.Module, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[residual +] linear(silu(gate) * up) for gate_up = [gate | up] along the last dimension (the residual is
        consumed, as in `linear`)."""
        ...

    def qkv_to_cache(
        self,
        layer: int,
        qkv: torch.Tensor,
        heads: HeadLayout,
        qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None,
        cache: KVCache,
        batch: ForwardBatch,
        meta: Any,
    ) -> torch.Tensor:
        """Split qkv [R, T, (H + 2Hkv)·D]; per-head RMSNorm of q and k (Qwen3) when given; RoPE;
        store k, v at the batch's write slots; return the rotated q [R, T, H, D]."""
        ...

    def attend(self, layer: int, q: torch.Tensor, cache: KVCache, batch: ForwardBatch, meta: Any) -> torch.Tensor:
        """Attention of q [R, T, H, D] over each row's keys (causal by column, or `batch.mask`); [R, T, H·D]."""
        ...

    def pending_tokens(
        self, seq: torch.Tensor, seq_len: torch.Tensor, kv_len: torch.Tensor, rows: torch.Tensor, leave: int, width: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each row's KV length (`start`), its tokens past it but the last `leave` (`count`, at least 0), and those
        tokens padded with 0 to `width` (columns clamped to the capacity): (start, count, tokens [R, width])."""
        ...

    def append_tokens(self, seq: torch.Tensor, seq_len: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """seq[row, seq_len[row] + j] = tokens[i, j] (columns clamped to the capacity), seq_len[row] += m."""
        ...

    def append_slots(
        self, tables: BlockTables, rows: torch.Tensor, counts: torch.Tensor, width: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`BlockTables.append`: counts[i] <= width new slots (the lowest-numbered free ones) at the end of row
        rows[i]: (slots [R, width] (the trash slot past counts[i]), each row's length before, the new tokens'
        columns [R, width] (`padded_columns`))."""
        ...

    def rollback_slots(
        self, tables: BlockTables, rows: torch.Tensor, values: torch.Tensor, max_drop: int, to_length: bool
    ) -> None:
        """Drop values[i] (0..max_drop) tokens from the end of row rows[i], or with `to_length` cut it to at most
        values[i] tokens; rows unique."""
        ...

    def gumbel_max(
        self, logits: torch.Tensor, scale: torch.Tensor, floor: torch.Tensor, keys: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """argmax(ℓ·scale + g) over the entries ℓ >= floor per row of logits [R, V] (g: Gumbel noise keyed by
        keys [R]; scale 0: the plain argmax, log-probability 0), and the drawn entry's log_softmax: (int64 [R],
        float32 [R])."""
        ...

    def stream_keys(
        self, key: torch.Tensor, rows: torch.Tensor, purpose: int, positions: torch.Tensor | int
    ) -> torch.Tensor:
        """The keys of the rows' draws of `purpose` at `positions` ([R], [R, k] or one int), the rows keyed
        key[rows]: `counter_hash.keys_of_draws`'s bits."""
        ...

    def logsumexp_rows(self, logits: torch.Tensor, scale: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
        """float64 [R]: logsumexp of logits[r, v] · scale[r] (float64) over the v with logits[r, v] >= floor[r],
        in float64 (the SMC weights' precision); -inf for a row with nothing kept."""
        ...

    def draw_children(self, logq: torch.Tensor, k: int, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k children per drafter law logq [..., V], drawn without replacement in draw order (Gumbel-top-k, the
        noise keyed by keys [...] alone), and the slot log-probabilities (the k largest logq, descending):
        (int64 [..., k], float32 [..., k]). A deterministic tree's children are torch's top-k on every device
        (`levels.tree.top_children`)."""
        ...

    def tree_walk(
        self,
        rule: str,
        parent: torch.Tensor,
        tokens: torch.Tensor,
        p: torch.Tensor,
        q: torch.Tensor | None,
        u: torch.Tensor,
        max_children: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The walk of tree rule `rule` over draft trees (`hsmc.speculative.tree_verify`): the node each row stops
        at [R] and the normalised law of the token after it [R, V]; no node has more than `max_children`
        children."""
        ...


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: statistics in fp32, normalized value cast back, then scaled."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_cos_sin(rope: Rope, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [..., 1, D] computed like transformers: fp32 angles, scaled, cast to `dtype`."""
    freqs = positions[..., None].float() * rope.inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[..., None, :]
    return (emb.cos() * rope.scale).to(dtype), (emb.sin() * rope.scale).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


def attention_mask(batch: ForwardBatch) -> torch.Tensor:
    """bool [R, T, L]: causality by column (a query sees the keys at columns <= its own), or `batch.mask`
    within the row's context."""
    key_cols = torch.arange(batch.max_context, device=batch.tokens.device)
    if batch.mask is not None:
        return batch.mask & (key_cols[None, None, :] < batch.context_lens[:, None, None])
    return key_cols[None, None, :] <= batch.query_cols[:, :, None]


@dataclass(frozen=True)
class TorchMeta:
    mask: torch.Tensor  # bool [R, 1, T, L]
    cos: torch.Tensor  # [R, T, 1, D]
    sin: torch.Tensor


class TorchBackend:
    """Reference kernels: gather + SDPA, exact in fp32, any device; differentiable (EAGLE3 training)."""

    name = "torch"

    def prepare(self, batch: ForwardBatch, rope: Rope, dtype: torch.dtype) -> TorchMeta:
        cos, sin = rope_cos_sin(rope, batch.positions, dtype)
        return TorchMeta(attention_mask(batch)[:, None], cos, sin)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm_reference(x, weight, eps)

    def linear(self, x: torch.Tensor, linear: nn.Module, residual: torch.Tensor | None = None) -> torch.Tensor:
        return linear(x) if residual is None else residual + linear(x)

    def norm_linear(self, stream: torch.Tensor, norm: RMSNormWeight, linear: nn.Module) -> torch.Tensor:
        return linear(rms_norm_reference(stream, norm.weight, norm.eps))

    def silu_linear(
        self, gate_up: torch.Tensor, linear: nn.Module, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.linear(F.silu(gate) * up, linear, residual)

    def qkv_to_cache(
        self,
        layer: int,
        qkv: torch.Tensor,
        heads: HeadLayout,
        qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None,
        cache: KVCache,
        batch: ForwardBatch,
        meta: TorchMeta,
    ) -> torch.Tensor:
        r, t, _ = qkv.shape
        q, k, v = qkv.split(heads.sizes, dim=-1)
        q = q.view(r, t, heads.num_heads, heads.head_dim)
        k = k.view(r, t, heads.num_kv_heads, heads.head_dim)
        v = v.view(r, t, heads.num_kv_heads, heads.head_dim)
        if qk_norm is not None:
            q_weight, k_weight, eps = qk_norm
            q, k = rms_norm_reference(q, q_weight, eps), rms_norm_reference(k, k_weight, eps)
        q, k = apply_rope(q, meta.cos, meta.sin), apply_rope(k, meta.cos, meta.sin)
        slots = batch.write_slots.reshape(-1)
        cache.keys(layer)[slots] = k.reshape(-1, heads.num_kv_heads, heads.head_dim)
        cache.values(layer)[slots] = v.reshape(-1, heads.num_kv_heads, heads.head_dim)
        return q

    def attend(self, layer: int, q: torch.Tensor, cache: KVCache, batch: ForwardBatch, meta: TorchMeta) -> torch.Tensor:
        key_slots = batch.table[batch.rows, : batch.max_context]
        context_k = cache.keys(layer)[key_slots].transpose(1, 2)  # [R, Hkv, L, D]
        context_v = cache.values(layer)[key_slots].transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), context_k, context_v, attn_mask=meta.mask, enable_gqa=True
        )
        return out.transpose(1, 2).reshape(q.shape[0], q.shape[1], -1)

    def pending_tokens(
        self, seq: torch.Tensor, seq_len: torch.Tensor, kv_len: torch.Tensor, rows: torch.Tensor, leave: int, width: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        start = kv_len[rows]
        count = (seq_len[rows] - leave - start).clamp_min(0)
        return start, count, sequence_window(seq, rows, start, count, width)

    def append_tokens(self, seq: torch.Tensor, seq_len: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        columns = torch.arange(tokens.shape[1], device=tokens.device)
        seq[rows[:, None], (seq_len[rows][:, None] + columns).clamp_max(seq.shape[1] - 1)] = tokens
        seq_len[rows] += tokens.shape[1]

    def append_slots(
        self, tables: BlockTables, rows: torch.Tensor, counts: torch.Tensor, width: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        start = tables.length[rows]
        torch._assert_async((start + counts <= tables.max_row_tokens).all(), ROW_OVERFLOW)
        slots = tables.allocator.alloc(counts, width)
        cols = start[:, None] + torch.arange(width, device=rows.device)
        cols = torch.where(cols < (start + counts)[:, None], cols, tables.max_row_tokens)
        tables.table[rows[:, None], cols] = slots
        tables.length[rows] = start + counts
        return slots, start, padded_columns(start, counts, width)

    def rollback_slots(
        self, tables: BlockTables, rows: torch.Tensor, values: torch.Tensor, max_drop: int, to_length: bool
    ) -> None:
        end = tables.length[rows]
        counts = (end - values).clamp_min(0) if to_length else values
        torch._assert_async(((counts >= 0) & (counts <= end) & (counts <= max_drop)).all(), BAD_ROLLBACK)
        back = torch.arange(1, max_drop + 1, device=rows.device)
        cols = (end[:, None] - back[None, :]).clamp_min(0)  # [R, max_drop], last column first
        dropped = back[None, :] <= counts[:, None]
        tables.allocator.add_refs(tables.table[rows[:, None], cols], -dropped.to(torch.int32))
        tables.length[rows] = end - counts

    def gumbel_max(
        self, logits: torch.Tensor, scale: torch.Tensor, floor: torch.Tensor, keys: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = logits.float()
        scaled = torch.where(x >= floor[:, None], x * scale[:, None], float("-inf"))
        greedy = scale == 0
        score = torch.where(greedy[:, None], x, scaled + gumbel(keys, x.shape[-1]))
        tokens = score.argmax(-1)
        logprobs = torch.log_softmax(scaled, -1).gather(-1, tokens[:, None]).squeeze(-1)
        return tokens, torch.where(greedy, 0.0, logprobs)

    def stream_keys(
        self, key: torch.Tensor, rows: torch.Tensor, purpose: int, positions: torch.Tensor | int
    ) -> torch.Tensor:
        return keys_of_draws(key[rows], purpose, positions)

    def logsumexp_rows(self, logits: torch.Tensor, scale: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
        kept = logits.float() >= floor[:, None]
        return torch.logsumexp(torch.where(kept, logits.double() * scale[:, None], float("-inf")), -1)

    def draw_children(self, logq: torch.Tensor, k: int, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (logq + gumbel(keys, logq.shape[-1])).topk(k, dim=-1).indices, logq.topk(k, dim=-1).values

    def tree_walk(
        self,
        rule: str,
        parent: torch.Tensor,
        tokens: torch.Tensor,
        p: torch.Tensor,
        q: torch.Tensor | None,
        u: torch.Tensor,
        max_children: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if rule == "traversal":
            return verify_tree_traversal(parent, tokens, p, q, u)
        return verify_tree(parent, tokens, p, q, u)


def sequence_window(
    seq: torch.Tensor, rows: torch.Tensor, start: torch.Tensor, count: torch.Tensor, width: int
) -> torch.Tensor:
    """seq[row, start + j] for j < count (0 past it, columns clamped to the capacity): [R, width]."""
    offsets = torch.arange(width, device=rows.device)
    cols = (start[:, None] + offsets).clamp(0, seq.shape[1] - 1)
    return torch.where(offsets[None, :] < count[:, None], seq[rows[:, None], cols], 0)
