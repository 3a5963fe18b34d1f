"""The Triton backend: the same steps as `TorchBackend` in fused kernels, and paged attention over the
block tables (`paged_attention.py`). Selected by `engine.attention: triton` (the default on CUDA); it
also runs on the CPU under `TRITON_INTERPRET=1`, which is how the suite checks it against the reference
without a GPU.

A Linear of one row (batch-1 decode) is one `decode_linear` kernel with its norm or SiLU·mul and its
residual add inside, chained to the next kernel by programmatic dependent launch. 2..16 rows of dense
weights (17..32 where the GPU has a measured plan for the weight) run `few_row_linear` (tensor cores, the
residual add inside, PDL) after a separate RMSNorm or SiLU·mul kernel (`fused.py`); more rows, or FP8
weights, a GEMM (cuBLAS, or cuBLASLt and more rows where measured faster for the shape: `gemm_routes.py`; the
residual as its `beta` term, or an FP8 GEMM with a residual epilogue: weight-only, or with
`engine.fp8_activations` on FP8 activations) after the same kernels."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from hsmc.ops import fused, kv_slots, token_rows, vocab
from hsmc.ops.backend import BAD_ROLLBACK, OUT_OF_SLOTS, OVER_RELEASED, ROW_OVERFLOW, HeadLayout, RMSNormWeight, Rope
from hsmc.ops.batch import ForwardBatch
from hsmc.ops.decode_linear import decode_linear
from hsmc.ops.few_row_linear import MAX_ROWS, few_row_linear, measured_plan
from hsmc.ops.fp8_linear import Fp8Linear, fp8_linear
from hsmc.ops.gemm_routes import blas_library_for, gemm_rows
from hsmc.ops.kv_cache import KVCache
from hsmc.ops.paged_attention import AttentionPlan, paged_attention, plan_attention

if TYPE_CHECKING:
    from hsmc.engine.kv_pool import BlockTables


@dataclass(frozen=True)
class TritonMeta:
    rope: Rope
    plans: dict[tuple[int, int], AttentionPlan]  # by (heads, kv heads): a model has one layout


class TritonBackend:
    name = "triton"

    def __init__(self) -> None:
        self.sm_count = (
            torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
            if torch.cuda.is_available()
            else 4
        )

    def prepare(self, batch: ForwardBatch, rope: Rope, dtype: torch.dtype) -> TritonMeta:
        return TritonMeta(rope, {})

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return fused.rms_norm(x, weight, eps)

    def linear(self, x: torch.Tensor, linear: nn.Module, residual: torch.Tensor | None = None) -> torch.Tensor:
        if _one_row(x, linear):
            return decode_linear(x, **_weights(linear), residual=residual)
        if _few_rows(x, linear):
            return few_row_linear(x, linear.weight, bias=linear.bias, residual=residual)
        return _matmul(x, linear, residual)

    def norm_linear(self, stream: torch.Tensor, norm: RMSNormWeight, linear: nn.Module) -> torch.Tensor:
        if _one_row(stream, linear):
            return decode_linear(stream, **_weights(linear), norm=(norm.weight, norm.eps))
        if _few_rows(stream, linear):
            return few_row_linear(stream, linear.weight, bias=linear.bias, norm=(norm.weight, norm.eps))
        return _norm_matmul(stream, norm, linear)

    def silu_linear(self, gate_up: torch.Tensor, linear: nn.Module, residual: torch.Tensor) -> torch.Tensor:
        if _one_row(gate_up, linear):
            return decode_linear(gate_up, **_weights(linear), silu_mul=True, residual=residual)
        if _few_rows(gate_up, linear):
            return few_row_linear(gate_up, linear.weight, bias=linear.bias, silu_mul=True, residual=residual)
        return _matmul(fused.silu_mul(gate_up), linear, residual)

    def qkv_to_cache(
        self,
        layer: int,
        qkv: torch.Tensor,
        heads: HeadLayout,
        qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None,
        cache: KVCache,
        batch: ForwardBatch,
        meta: TritonMeta,
    ) -> torch.Tensor:
        return fused.qkv_rope_store(
            qkv,
            heads.num_heads,
            heads.num_kv_heads,
            heads.head_dim,
            qk_norm,
            batch.positions,
            meta.rope.inv_freq,
            meta.rope.scale,
            batch.write_slots,
            cache.keys(layer),
            cache.values(layer),
        )

    def attend(
        self, layer: int, q: torch.Tensor, cache: KVCache, batch: ForwardBatch, meta: TritonMeta
    ) -> torch.Tensor:
        r, t, h, _ = q.shape
        keys = cache.keys(layer)
        key = (h, keys.shape[1])
        if key not in meta.plans:
            meta.plans[key] = plan_attention(r, t, batch.max_context, h, keys.shape[1], self.sm_count)
        out = paged_attention(
            q,
            keys,
            cache.values(layer),
            batch.table,
            batch.rows,
            batch.start,
            batch.num_new,
            meta.plans[key],
            batch.mask,
        )
        return out.view(r, t, -1)

    def pending_tokens(
        self, seq: torch.Tensor, seq_len: torch.Tensor, kv_len: torch.Tensor, rows: torch.Tensor, leave: int, width: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return token_rows.pending_tokens(seq, seq_len, kv_len, rows, leave, width)

    def append_tokens(self, seq: torch.Tensor, seq_len: torch.Tensor, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        token_rows.append_tokens(seq, seq_len, rows, tokens)

    def append_slots(
        self, tables: BlockTables, rows: torch.Tensor, counts: torch.Tensor, width: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        slots, start, columns, ok = kv_slots.append_slots(
            tables.allocator.refcount, tables.table, tables.length, rows, counts, width, tables.max_row_tokens
        )
        torch._assert_async(ok[0], OUT_OF_SLOTS)
        torch._assert_async(ok[1], ROW_OVERFLOW)
        return slots, start, columns

    def rollback_slots(
        self, tables: BlockTables, rows: torch.Tensor, values: torch.Tensor, max_drop: int, to_length: bool
    ) -> None:
        refcount = tables.allocator.refcount
        ok = kv_slots.rollback_slots(refcount, tables.table, tables.length, rows, values, max_drop, to_length)
        torch._assert_async(ok[0], BAD_ROLLBACK)
        torch._assert_async(ok[1], OVER_RELEASED)

    def gumbel_max(
        self, logits: torch.Tensor, scale: torch.Tensor, floor: torch.Tensor, keys: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return vocab.gumbel_max(logits, scale.float(), floor.float(), keys)

    def logsumexp_rows(self, logits: torch.Tensor, scale: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
        return vocab.logsumexp_rows(logits, scale.double(), floor.float())


def _one_row(x: torch.Tensor, linear: nn.Module) -> bool:
    """One row goes through `decode_linear` (FP8 when its tiles fit the scale blocks, as Qwen's 128x128 do)."""
    return x.numel() == x.shape[-1] and (not isinstance(linear, Fp8Linear) or linear.block[0] % 8 == 0)


def _few_rows(x: torch.Tensor, linear: nn.Module) -> bool:
    """2..16 rows of dense weights go through `few_row_linear`, 17..32 where this GPU has a measured 32-row plan
    for the weight (it beat cuBLAS there); FP8 weights keep their GEMM."""
    rows = x.numel() // x.shape[-1]
    if isinstance(linear, Fp8Linear) or rows > MAX_ROWS:
        return False
    return rows <= 16 or measured_plan(*linear.weight.shape, rows, x.device) is not None


def _weights(linear: nn.Module) -> dict:
    if isinstance(linear, Fp8Linear):
        return dict(weight=linear.weight, scale=linear.weight_scale_inv, scale_block=linear.block, bias=linear.bias)
    return dict(weight=linear.weight, bias=linear.bias)


def _matmul(x: torch.Tensor, linear: nn.Module, residual: torch.Tensor | None) -> torch.Tensor:
    """[residual +] linear(x) as one GEMM where the GEMM can add the residual: cuBLAS accumulates into the
    (consumed) residual in place, as `torch.addmm` into a new tensor would first copy it there (a copy node
    per Linear that breaks the chain of dependent launches: two per layer in a verify). Dense GEMMs run in the
    BLAS library measured faster for their shape on this GPU (`gemm_routes.py`)."""
    if isinstance(linear, Fp8Linear):
        return fp8_linear(
            x, linear.weight, linear.weight_scale_inv, linear.bias, linear.block, residual, linear.dynamic_activations
        )
    n, k = linear.weight.shape
    with blas_library_for(n, k, x.numel() // k, x.device):
        if residual is None:
            return F.linear(x, linear.weight, linear.bias)
        if linear.bias is not None or not residual.is_contiguous():
            return residual + F.linear(x, linear.weight, linear.bias)
        residual.view(-1, n).addmm_(x.reshape(-1, k), linear.weight.t())
        return residual


def _norm_matmul(stream: torch.Tensor, norm: RMSNormWeight, linear: nn.Module) -> torch.Tensor:
    """linear(RMSNorm(stream)) through a GEMM, run at the rows measured fastest for the dense weight on this GPU
    (`gemm_routes.PADDED_ROWS`): the norm writes its rows into a taller buffer whose extra rows stay unset, and only
    the GEMM's first rows are kept (each output row depends on its own input row alone)."""
    k = stream.shape[-1]
    rows = stream.numel() // k
    run = rows if isinstance(linear, Fp8Linear) else gemm_rows(linear.weight.shape[0], k, rows, stream.device)
    if run == rows:
        return _matmul(fused.rms_norm(stream, norm.weight, norm.eps), linear, None)
    normed = stream.new_empty(run, k)
    fused.rms_norm(stream, norm.weight, norm.eps, out=normed[:rows])
    return _matmul(normed, linear, None)[:rows].view(*stream.shape[:-1], -1)
