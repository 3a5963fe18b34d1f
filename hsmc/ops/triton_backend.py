"""The Triton backend: the steps of `TorchBackend` in fused kernels and paged attention over the block tables.
Selected by `engine.attention: triton` (the default on CUDA); on the CPU it runs under `TRITON_INTERPRET=1`, which
is how the suite checks it against the reference without a GPU. Each Linear runs the route `linear_router.py`
picks for its shape (`run_route` executes one)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from hsmc.ops import fused, kv_slots, stream_keys, token_rows, vocab
from hsmc.ops.backend import BAD_ROLLBACK, OUT_OF_SLOTS, OVER_RELEASED, ROW_OVERFLOW, HeadLayout, RMSNormWeight, Rope
from hsmc.ops.batch import ForwardBatch
from hsmc.ops.decode_linear import decode_linear
from hsmc.ops.few_row_linear import few_row_linear
from hsmc.ops.flashinfer_gemm import flashinfer_block_scaled_matmul
from hsmc.ops.fp8_gemm import (
    block_scaled_matmul,
    fp8_gemm,
    quantize_groups,
    rms_norm_quantize,
    silu_mul_quantize,
    w8a8_matmul,
)
from hsmc.ops.fp8_linear import Fp8Linear, dequantize_fp8, quantize_activations
from hsmc.ops.kv_cache import KVCache
from hsmc.ops.linear_router import Kernel, Route, router_for
from hsmc.ops.paged_attention import AttentionPlan, paged_attention, plan_attention, shared_columns, shares_prefix
from hsmc.ops.tree_walk import tree_walk

if TYPE_CHECKING:
    from hsmc.engine.kv_pool import BlockTables


@dataclass(frozen=True)
class TritonMeta:
    rope: Rope
    plans: dict[tuple[int, int], AttentionPlan]  # by (heads, kv heads): a model has one layout
    shared: torch.Tensor | None  # each run's shared prefix columns (`shared_columns`), where attention reads them once


class TritonBackend:
    name = "triton"

    def __init__(self) -> None:
        self.sm_count = (
            torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
            if torch.cuda.is_available()
            else 4
        )

    def prepare(self, batch: ForwardBatch, rope: Rope, dtype: torch.dtype) -> TritonMeta:
        r, t = batch.tokens.shape
        shared = None
        if shares_prefix(r, t, batch.max_context, batch.prefix_run, batch.mask is not None):
            shared = shared_columns(batch.table, batch.rows, batch.start, batch.num_new, batch.prefix_run)
        return TritonMeta(rope, {}, shared)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return fused.rms_norm(x, weight, eps)

    def linear(self, x: torch.Tensor, linear: nn.Module, residual: torch.Tensor | None = None) -> torch.Tensor:
        return run_route(_plan(x, linear), x, linear, residual=residual)

    def norm_linear(self, stream: torch.Tensor, norm: RMSNormWeight, linear: nn.Module) -> torch.Tensor:
        return run_route(_plan(stream, linear, norm_fed=True), stream, linear, norm=(norm.weight, norm.eps))

    def silu_linear(
        self, gate_up: torch.Tensor, linear: nn.Module, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        return run_route(_plan(gate_up, linear), gate_up, linear, silu_mul=True, residual=residual)

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
            run = batch.prefix_run if meta.shared is not None else 1
            meta.plans[key] = plan_attention(r, t, batch.max_context, h, keys.shape[1], self.sm_count, run)
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
            meta.shared,
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

    def stream_keys(
        self, key: torch.Tensor, rows: torch.Tensor, purpose: int, positions: torch.Tensor | int
    ) -> torch.Tensor:
        return stream_keys.stream_keys(key, rows, purpose, positions)

    def logsumexp_rows(self, logits: torch.Tensor, scale: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
        return vocab.logsumexp_rows(logits, scale.double(), floor.float())

    def draw_children(self, logq: torch.Tensor, k: int, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return vocab.gumbel_top_k(logq, keys, k)

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
        return tree_walk(rule, parent, tokens, p, q, u, max_children)


def _plan(x: torch.Tensor, linear: nn.Module, norm_fed: bool = False) -> Route:
    return router_for(x.device).plan(x.shape, linear, x.dtype, norm_fed)


def run_route(
    route: Route,
    x: torch.Tensor,
    linear: nn.Module,
    *,
    norm: tuple[torch.Tensor, float] | None = None,
    silu_mul: bool = False,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """[residual +] linear(prologue(x)) through `route`; the prologue is RMSNorm with `norm` = (weight, eps) or
    SiLU·mul of x = [gate | up] (a residual is consumed: the result may be that tensor, added into)."""
    if route.kernel is Kernel.ONE_ROW:
        return decode_linear(
            x, **_weights(linear), norm=norm, silu_mul=silu_mul, residual=residual, plan=route.one_row_plan
        )
    if route.kernel is Kernel.FEW_ROWS:
        return few_row_linear(
            x, linear.weight, bias=linear.bias, norm=norm, silu_mul=silu_mul, residual=residual, plan=route.few_row_plan
        )
    n, k = linear.weight.shape
    rows = x.numel() // x.shape[-1]
    residual = residual.reshape(rows, n) if residual is not None else None
    if route.kernel in (Kernel.FP8_ACT_TRITON, Kernel.FP8_ACT_CUBLASLT, Kernel.FP8_ACT_FLASHINFER):
        q, q_scale = _quantized_prologue(route, x, linear, norm, silu_mul)
        out = _fp8_act_gemm(route, q, q_scale, linear, x.dtype, rows, residual)
        return out.view(*x.shape[:-1], n)
    if norm is not None:  # into the first rows of a buffer of the route's rows: the rest is never read back
        inputs = x.new_empty(route.run_rows if route.kernel is Kernel.BLAS else rows, k)
        fused.rms_norm(x, *norm, out=inputs[:rows])
    else:
        inputs = fused.silu_mul(x.contiguous()) if silu_mul else x
    out = _gemm(route, inputs.reshape(-1, k), linear, residual)
    return out[:rows].view(*x.shape[:-1], n)


def _quantized_prologue(
    route: Route, x: torch.Tensor, linear: nn.Module, norm: tuple[torch.Tensor, float] | None, silu_mul: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """prologue(x) (x without one) quantized per row and scale block of columns, in the prologue's kernel where
    there is one (the normalized or gated rows never go through memory in bf16): e4m3 rows and their scales laid
    out for the route's GEMM (cuBLASLt, flashinfer: `run_rows` tall, column-major scales)."""
    group = linear.block[1]
    layout = dict(rows=route.run_rows, column_major_scales=route.kernel is not Kernel.FP8_ACT_TRITON)
    if norm is not None:
        return rms_norm_quantize(x, *norm, group, **layout)
    if silu_mul:
        return silu_mul_quantize(x, group, **layout)
    return quantize_groups(x.reshape(-1, x.shape[-1]).contiguous(), group, **layout)


def _fp8_act_gemm(
    route: Route,
    q: torch.Tensor,
    q_scale: torch.Tensor,
    linear: nn.Module,
    dtype: torch.dtype,
    rows: int,
    residual: torch.Tensor | None,
) -> torch.Tensor:
    """[residual +] (q * q_scale) @ weight^T [+ bias] in `dtype` for the FP8-activation routes: [rows, N]."""
    weight, scale, bias = linear.weight, linear.weight_scale_inv, linear.bias
    if route.kernel is Kernel.FP8_ACT_TRITON:
        if bias is None:  # the kernel adds the residual as it rounds
            return w8a8_matmul(q, q_scale, weight, scale, linear.block, dtype, residual=residual)
        out = w8a8_matmul(q, q_scale, weight, scale, linear.block, dtype) + bias
    else:
        if route.kernel is Kernel.FP8_ACT_FLASHINFER:  # bf16 only, as the router sends it
            out = flashinfer_block_scaled_matmul(q, q_scale, weight, scale, rows)
        else:
            out = block_scaled_matmul(q, q_scale, weight, scale, dtype, rows)
        out = out + bias if bias is not None else out
    return out if residual is None else residual + out


def _gemm(route: Route, x: torch.Tensor, linear: nn.Module, residual: torch.Tensor | None) -> torch.Tensor:
    """[residual +] x @ weight^T [+ bias] for the GEMM routes of dense inputs, x [rows, K] (BLAS: [run_rows, K])."""
    kernel, bias = route.kernel, linear.bias
    if kernel is Kernel.BLAS:
        with _blas_library(route.cublaslt):
            if residual is None:
                return F.linear(x, linear.weight, bias)
            if bias is not None or not residual.is_contiguous():
                return residual + F.linear(x, linear.weight, bias)
            # cuBLAS accumulates into the (consumed) residual in place: `addmm` would first copy it
            return residual.addmm_(x, linear.weight.t())
    weight, scale, block = linear.weight, linear.weight_scale_inv, linear.block
    if kernel is Kernel.FP8_TRITON:
        if bias is None:  # the kernel adds the residual as it rounds
            return fp8_gemm(x, weight, scale, block, residual=residual)
        out = fp8_gemm(x, weight, scale, block) + bias
    else:  # FP8_DEQUANTIZED, FP8_ACT_REFERENCE
        x = quantize_activations(x, block[1]) if kernel is Kernel.FP8_ACT_REFERENCE else x
        out = F.linear(x, dequantize_fp8(weight, scale, block, x.dtype), bias)
    return out if residual is None else residual + out


@contextmanager
def _blas_library(cublaslt: bool) -> Iterator[None]:
    """cuBLASLt inside the block when asked for (a CUDA graph keeps the kernel chosen at capture); torch's choice
    otherwise, and restored after."""
    if not cublaslt:
        yield
        return
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def _weights(linear: nn.Module) -> dict:
    if isinstance(linear, Fp8Linear):
        return dict(weight=linear.weight, scale=linear.weight_scale_inv, scale_block=linear.block, bias=linear.bias)
    return dict(weight=linear.weight, bias=linear.bias)
