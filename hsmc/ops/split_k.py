"""Split-K and the epilogue the matmul kernels share.

A matmul over few rows has too few output tiles to fill the GPU, so K is split over programs that write
fp32 partials and one small kernel sums them and runs the epilogue (`sum_splits`); with one split a
kernel runs the same epilogue itself (`finish`). Used by the few-row Linears and the FP8 GEMMs."""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

from hsmc.ops.pdl import pdl_launch
from hsmc.ops.tiles import round_to


@cache
def multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def splits_to_fill(tiles: int, k_tiles: int, device: torch.device) -> int:
    """K splits for `tiles` output tiles: enough to cover this GPU's SMs while the tiles would leave a quarter of
    them idle (below that, the extra summing kernel costs more than it saves), at most one per K tile."""
    sms = multiprocessors(device)
    return min(triton.cdiv(sms, tiles) if 4 * tiles < 3 * sms else 1, k_tiles)


@triton.jit
def finish(y, offs, n_idx, ok, bias_ptr, res_ptr, out_ptr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """The epilogue on fp32 sums y at output offsets `offs` (column `n_idx`): bias, rounding, residual add
    (the output rounded first, as the torch reference rounds the Linear's result before adding)."""
    dtype = out_ptr.dtype.element_ty
    if HAS_BIAS:
        y += tl.load(bias_ptr + n_idx, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        y = round_to(y, dtype) + tl.load(res_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, y.to(dtype), mask=ok)


@triton.jit(do_not_specialize=["size"])
def _sum_splits_kernel(
    partial_ptr,
    bias_ptr,
    res_ptr,
    out_ptr,
    size,
    N,
    SPLIT_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < size
    y = tl.zeros([BLOCK], dtype=tl.float32)
    for i in tl.static_range(SPLIT_K):
        y += tl.load(partial_ptr + i * size + offs, mask=ok, other=0.0)
    finish(y, offs, offs % N, ok, bias_ptr, res_ptr, out_ptr, HAS_BIAS, HAS_RESIDUAL)


def sum_splits(
    partial: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None
) -> None:
    """out [M, N] = epilogue(sum of partial [S, M, N] fp32 over S); `residual` contiguous [M, N]."""
    size, n = out.numel(), out.shape[-1]
    _sum_splits_kernel[(triton.cdiv(size, 1024),)](
        partial, bias if bias is not None else out, residual if residual is not None else out, out, size, n,
        SPLIT_K=partial.shape[0], HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, BLOCK=1024,
        num_warps=4, **pdl_launch(out.device),
    )  # fmt: skip
