"""Weight-only FP8 matmul in Triton: y = x @ dequant(W)^T with W float8_e4m3fn and one scale per block.

Decode reads every weight once per step, so a step's time is the bytes it reads: an FP8 weight is half
the bytes of bf16. Two kernels, both fp32-accumulating, one chosen per problem by `plan_fp8_gemm`:

- one row (batch-1 decode): no tensor cores. Each program streams a few weight rows over a long K tile
  (several scale blocks: long contiguous loads, marked evict-first since each byte is read once), sums
  each scale block's products, scales them and accumulates. Measured on an H200 this reads 1.2-1.4x faster
  than the dot kernel at M = 1 (`docs/engine.md`, FP8).
- more rows: the FP8 tile is converted to the activation dtype (exact: every e4m3 value is a bf16/fp16/fp32
  value), a tensor-core dot accumulates in fp32 and the partial product is scaled per K tile (a K tile
  never straddles a scale block, so the scale is constant along it).

Few rows give too few output tiles to fill the GPU, so K is split across programs whose fp32 partials one
more small kernel sums and rounds (split-K); with one split the kernel writes the output itself.
`dequantize_fp8_triton` expands a weight for the many-row case, where cuBLAS on the dequantized matrix wins.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class Fp8GemmPlan:
    """Kernel, tile sizes, K splits and launch settings of one (rows, N, K) problem; `block_m` 0 = the
    one-row kernel (one program per row, `block_k` a multiple of the scale block)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3


@cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def plan_fp8_gemm(m: int, n: int, k: int, scale_block_k: int, device: torch.device) -> Fp8GemmPlan:
    """Settings that measured best on an H200 over the Qwen3-8B/32B Linears (`scripts/gpu_engine_check.py
    --sections fp8gemm` sweeps them): one row streams 4 KiB-per-row tiles over 4-8 rows per program; more
    rows split K until there are about four programs per SM."""
    if m == 1:
        block_n, block_k = (8, 512) if n >= 6144 else (4, 1024)
        block_k = max(scale_block_k, block_k // scale_block_k * scale_block_k)
        return Fp8GemmPlan(0, block_n, block_k, 1, num_warps=4, num_stages=3)
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n = 64 if m <= 64 else 128
    block_k = min(128, scale_block_k)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    wanted = triton.next_power_of_2(triton.cdiv(4 * _multiprocessors(device), tiles))
    split_k = max(1, min(triton.cdiv(k, block_k), wanted))
    return Fp8GemmPlan(block_m, block_n, block_k, split_k, num_warps=4, num_stages=3)


@triton.jit
def _fp8_gemm_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    k_per_split,
    SCALE_N: tl.constexpr,
    SCALE_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    scale_row = s_ptr + (rn // SCALE_N) * stride_sn
    for k0 in range(k_begin, k_end, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        scale = tl.load(scale_row + k0 // SCALE_K, mask=n_ok, other=0.0)
        if IEEE:
            part = tl.dot(x, tl.trans(w.to(x.dtype)), input_precision="ieee")
        else:
            part = tl.dot(x, tl.trans(w.to(x.dtype)))
        acc += part * scale[None, :]
    out = out_ptr + pid_k * M * N + rm[:, None] * N + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    k_per_split,
    SCALE_N: tl.constexpr,
    SCALE_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    blocks: tl.constexpr = BLOCK_K // SCALE_K
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(x_ptr + row * stride_xm + rk, mask=k_ok, other=0.0).to(tl.float32)
        w = tl.load(
            w_ptr + rn[:, None] * stride_wn + rk[None, :],
            mask=n_ok[:, None] & k_ok[None, :],
            other=0.0,
            eviction_policy="evict_first",
        )
        per_block = tl.sum(tl.reshape(w.to(tl.float32) * x[None, :], (BLOCK_N, blocks, SCALE_K)), axis=2)
        sb = k0 // SCALE_K + tl.arange(0, blocks)
        scale = tl.load(
            s_ptr + (rn // SCALE_N)[:, None] * stride_sn + sb[None, :],
            mask=n_ok[:, None] & (sb * SCALE_K < K)[None, :],
            other=0.0,
        )
        acc += tl.sum(per_block * scale, axis=1)
    tl.store(out_ptr + pid_k * M * N + row * N + rn, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _sum_splits_kernel(partial_ptr, out_ptr, size, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < size
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in tl.static_range(SPLIT_K):
        acc += tl.load(partial_ptr + i * size + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def fp8_gemm(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], plan: Fp8GemmPlan | None = None
) -> torch.Tensor:
    """x [M, K] (fp32/fp16/bf16) @ dequant(weight [N, K] fp8, scale [N/bn, K/bk])^T -> [M, N] in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    scale_n, scale_k = block
    plan = plan or plan_fp8_gemm(m, n, k, scale_k, x.device)
    if (plan.block_k % scale_k) if plan.block_m == 0 else (scale_k % plan.block_k):
        raise ValueError(f"K tile {plan.block_k} does not fit the scale block {scale_k} as this kernel needs")
    x = x.contiguous()
    k_per_split = triton.cdiv(triton.cdiv(k, plan.split_k), plan.block_k) * plan.block_k
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    # one split writes the output directly; several write fp32 partials that one more kernel sums
    partial = out if plan.split_k == 1 else torch.empty(plan.split_k, m, n, dtype=torch.float32, device=x.device)
    args = (x, weight, scale, partial, m, n, k, x.stride(0), weight.stride(0), scale.stride(0), k_per_split)
    launch = dict(SCALE_N=scale_n, SCALE_K=scale_k, num_warps=plan.num_warps, num_stages=plan.num_stages)
    if plan.block_m == 0:
        grid = (m, triton.cdiv(n, plan.block_n), plan.split_k)
        _fp8_gemv_kernel[grid](*args, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, **launch)
    else:
        grid = (triton.cdiv(m, plan.block_m), triton.cdiv(n, plan.block_n), plan.split_k)
        _fp8_gemm_kernel[grid](
            *args,
            BLOCK_M=plan.block_m,
            BLOCK_N=plan.block_n,
            BLOCK_K=plan.block_k,
            IEEE=x.dtype == torch.float32,
            **launch,
        )
    if plan.split_k > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](partial, out, m * n, SPLIT_K=plan.split_k, BLOCK=block)
    return out


@triton.jit
def _dequantize_kernel(
    w_ptr, s_ptr, out_ptr, N, K, stride_sn, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, BLOCK: tl.constexpr
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK + tl.arange(0, BLOCK)
    rk = pid_k * BLOCK + tl.arange(0, BLOCK)
    ok = (rn < N)[:, None] & (rk < K)[None, :]
    w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=ok, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + (rn // SCALE_N)[:, None] * stride_sn + (rk // SCALE_K)[None, :], mask=ok, other=0.0)
    tl.store(out_ptr + rn[:, None] * K + rk[None, :], (w * s).to(out_ptr.dtype.element_ty), mask=ok)


def dequantize_fp8_triton(
    weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """weight * scale (fp32 product, one rounding to `dtype`), without an fp32 copy of the matrix."""
    n, k = weight.shape
    out = torch.empty(n, k, dtype=dtype, device=weight.device)
    tile = 64
    grid = (triton.cdiv(n, tile), triton.cdiv(k, tile))
    _dequantize_kernel[grid](weight, scale, out, n, k, scale.stride(0), SCALE_N=block[0], SCALE_K=block[1], BLOCK=tile)
    return out
