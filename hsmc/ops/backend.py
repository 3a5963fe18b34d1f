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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from hsmc.ops.batch import ForwardBatch
from hsmc.ops.kv_cache import KVCache


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

    def silu_linear(self, gate_up: torch.Tensor, linear: nn.Module, residual: torch.Tensor) -> torch.Tensor:
        """residual + linear(silu(gate) * up) for gate_up = [gate | up] along the last dimension (the residual is
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

    def silu_linear(self, gate_up: torch.Tensor, linear: nn.Module, residual: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return residual + linear(F.silu(gate) * up)

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
