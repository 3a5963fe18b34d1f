"""The Linears of a one-row forward (batch-1 decode): each one kernel with its prologue (RMSNorm, or SiLU·mul; or
that step as its own kernel where the plan says so) and its epilogue (bias, residual add), chained by programmatic
dependent launch (`pdl.py`).

At one row a Linear reads its weight once and does almost no arithmetic, so a step lasts its weight bytes over the
bandwidth plus whatever leaves the memory idle: launch gaps, ramp-ups and tails, the small kernels between the
matmuls. Fusing removes the small kernels; PDL hides the gaps (a kernel loads its first weight tile, which nothing
in a forward writes, before it waits for the previous one). Dense weights accumulate elementwise, the next tile
loading into registers; FP8 weights sum each scale block, then scale it, and Triton pipelines their tiles (e4m3
bytes carried in registers are unpacked and repacked every tile; the dense structure over block-scaled inputs,
fewer instructions, measured no faster). Rounding follows `TorchBackend`. Measurements:
docs/measurements/2026-11-27-ops-notes.md, docs/measurements/2026-12-01-h200-fp8-one-row-folded-and-l2-prefetch.txt.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hsmc.ops import fused
from hsmc.ops.pdl import pdl_launch
from hsmc.ops.tiles import round_to, weight_tile

NO_PROLOGUE, RMS_NORM, SILU_MUL = 0, 1, 2


@dataclass(frozen=True)
class DecodeLinearPlan:
    """Weight rows per program, K tile and launch settings of one problem. `num_stages` is the depth of
    Triton's load pipeline: 3 for FP8 weights; 1 for dense weights, which load the next tile into registers
    themselves. `fuse_prologue` False runs the norm / SiLU·mul as its own PDL-chained kernel, so the
    matmul's programs do not repeat it for every tile."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 1
    fuse_prologue: bool = True


def plan_decode_linear(n: int, k: int, scale_block_k: int | None, prologue: int) -> DecodeLinearPlan:
    """Settings measured best on an H200 over the Qwen3 Linears: the norm fused into Linears of up to 8192 rows, a
    separate kernel before wider ones and before down (a fused prologue repeats per program); FP8 weights always
    take the separate kernel and pipeline 3 tiles, 4 rows per program below 6144 rows to fill the SMs."""
    if scale_block_k is not None:
        block_k = max(scale_block_k, 1024 // scale_block_k * scale_block_k)
        return DecodeLinearPlan(8 if n >= 6144 else 4, block_k, num_stages=3, fuse_prologue=False)
    if prologue == RMS_NORM and n <= 8192:
        return DecodeLinearPlan(16, 512)
    return DecodeLinearPlan(8, 1024, fuse_prologue=prologue == NO_PROLOGUE)


@triton.jit
def _input_tile(x_ptr, cols, ok, K, inv, norm_ptr, PROLOGUE: tl.constexpr, dtype: tl.constexpr):
    """Columns `cols` of the Linear's input after the prologue, fp32 [BLOCK_K]."""
    if PROLOGUE == 2:  # the row is [gate | up]
        gate = tl.load(x_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + K + cols, mask=ok, other=0.0).to(tl.float32)
        return round_to(round_to(gate / (1.0 + tl.exp(-gate)), dtype) * up, dtype)
    x = tl.load(x_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if PROLOGUE == 1:
        w = tl.load(norm_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        x = round_to(round_to(x * inv, dtype) * w, dtype)
    return x


@triton.jit
def _fp8_tile(acc, w, x, s_row, k0, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_K: tl.constexpr):
    """acc + one FP8 tile's products: each scale block summed, then scaled (K tiles start on a block)."""
    blocks: tl.constexpr = BLOCK_K // SCALE_K
    per_block = tl.sum(tl.reshape(w.to(tl.float32) * x[None, :], (BLOCK_N, blocks, SCALE_K)), axis=2)
    b = k0 // SCALE_K + tl.arange(0, blocks)
    return acc + tl.sum(per_block * tl.load(s_row + b, mask=b * SCALE_K < K, other=0.0)[None, :], axis=1)


@triton.jit
def _decode_linear_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    bias_ptr,
    norm_ptr,
    res_ptr,
    out_ptr,
    N,
    K,
    stride_wn,
    stride_sn,
    eps,
    PROLOGUE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    FP8: tl.constexpr,
    SCALE_N: tl.constexpr,
    SCALE_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    dtype = out_ptr.dtype.element_ty
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn
    if not FP8:  # weights are never written during a forward: the first tile loads before the wait
        w = weight_tile(w_rows, n_ok, rk, K)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

    inv = 0.0
    if PROLOGUE == 1:
        squares = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(x_ptr + k0 + rk, mask=k0 + rk < K, other=0.0).to(tl.float32)
            squares += x * x
        inv = tl.rsqrt(tl.sum(squares, 0) / K + eps)

    if FP8:  # each scale block of a tile summed, scaled, accumulated; Triton pipelines the tiles (loading the
        # first tile before the wait, as dense weights do, measured slower here)
        s_row = s_ptr + (pid * BLOCK_N // SCALE_N) * stride_sn  # a program's rows share one scale row
        y = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + rk
            w = weight_tile(w_rows, n_ok, cols, K)
            x = _input_tile(x_ptr, cols, cols < K, K, inv, norm_ptr, PROLOGUE, dtype)
            y = _fp8_tile(y, w, x, s_row, k0, K, BLOCK_N, BLOCK_K, SCALE_K)
    else:  # products summed elementwise, reduced once; the next tile loads while this one is multiplied
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + rk
            w_next = weight_tile(w_rows, n_ok, cols + BLOCK_K, K)
            acc += w.to(tl.float32) * _input_tile(x_ptr, cols, cols < K, K, inv, norm_ptr, PROLOGUE, dtype)[None, :]
            w = w_next
        y = tl.sum(acc, 1)

    if HAS_BIAS:
        y += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        y = round_to(y, dtype) + tl.load(res_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + rn, y.to(dtype), mask=n_ok)


def decode_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    scale: torch.Tensor | None = None,
    scale_block: tuple[int, int] | None = None,
    bias: torch.Tensor | None = None,
    norm: tuple[torch.Tensor, float] | None = None,
    silu_mul: bool = False,
    residual: torch.Tensor | None = None,
    plan: DecodeLinearPlan | None = None,
) -> torch.Tensor:
    """[residual +] (prologue(x) @ weight^T [+ bias]) for ONE row x [..., K] (or [..., 2K] = [gate | up] with
    `silu_mul`); the prologue is RMSNorm with `norm` = (weight, eps). `weight` [N, K] in x's dtype, or
    float8_e4m3fn with `scale` [N/bn, K/bk] per `scale_block` (bn, bk)."""
    n, k = weight.shape
    if x.numel() != (2 * k if silu_mul else k):
        raise ValueError(f"decode_linear takes one row of {2 * k if silu_mul else k} values, got {tuple(x.shape)}")
    fp8 = scale is not None
    scale_n, scale_k = scale_block if fp8 else (1, 1)
    prologue = SILU_MUL if silu_mul else (RMS_NORM if norm is not None else NO_PROLOGUE)
    plan = plan or plan_decode_linear(n, k, scale_k if fp8 else None, prologue)
    if fp8 and (scale_n % plan.block_n or plan.block_k % scale_k):
        raise ValueError(f"tile {plan.block_n}x{plan.block_k} does not fit the fp8 scale block {scale_block}")
    if not plan.fuse_prologue and prologue != NO_PROLOGUE:
        x = fused.rms_norm(x, *norm) if prologue == RMS_NORM else fused.silu_mul(x)
        prologue = NO_PROLOGUE
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    _decode_linear_kernel[(triton.cdiv(n, plan.block_n),)](
        x.contiguous(), weight, scale if fp8 else weight, bias if bias is not None else weight,
        norm[0] if norm is not None else weight, residual.contiguous() if residual is not None else out, out,
        n, k, weight.stride(0), scale.stride(0) if fp8 else 0, norm[1] if norm is not None else 0.0,
        PROLOGUE=prologue,
        HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, FP8=fp8, SCALE_N=scale_n, SCALE_K=scale_k,
        BLOCK_N=plan.block_n, BLOCK_K=plan.block_k,
        num_warps=plan.num_warps, num_stages=plan.num_stages, **pdl_launch(x.device),
    )  # fmt: skip
    return out
