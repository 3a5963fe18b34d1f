"""FP8 GEMMs over block-scaled FP8 weights (`fp8_linear.py`), for two or more rows.

- weight-only (`fp8_gemm`): each FP8 tile converted to the activations' dtype (exact) on the tensor cores, the
  product scaled per K tile; it keeps the weight read halved, which is what few rows are bound by.
- FP8 activations (`w8a8_gemm`, `engine.fp8_activations`): rows quantized to e4m3 per 128 columns
  (`quantize_groups`, the checkpoints' `activation_scheme: dynamic`), both operands on the FP8 tensor cores. After
  an RMSNorm or SiLU·mul the quantizer is that kernel too (`rms_norm_quantize`, `silu_mul_quantize`: the same
  bits, without writing the bf16 rows and reading them back).
- the same in cuBLASLt (`block_scaled_gemm`): its pipelined block-scaled kernel reaches the compute bound at many
  rows, where the Triton kernel, scaling each K tile before the next dot, does not; at a few rows its 128-wide
  tiles leave SMs idle and the Triton kernel (K split, PDL) is faster (the tuning file's threshold says from where).

Few rows give too few output tiles to fill the GPU, so K is split (`split_k.py`). The residual add rounds like the
reference. Measurements: docs/measurements/2026-11-27-ops-notes.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hsmc.ops.fused import rms_norm_row, rms_norm_warps, silu_mul_cols
from hsmc.ops.pdl import pdl_launch
from hsmc.ops.split_k import finish, multiprocessors, splits_to_fill, sum_splits
from hsmc.ops.tiles import round_to


@dataclass(frozen=True)
class Fp8GemmPlan:
    """Tile sizes, K splits and launch settings of one (rows, N, K) problem."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3


def plan_fp8_gemm(m: int, n: int, k: int, scale_block_k: int, device: torch.device) -> Fp8GemmPlan:
    """Tiles that measured best on an H200 over the Qwen3 Linears; K split to about four programs per SM."""
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n = 64 if m <= 64 else 128
    block_k = min(128, scale_block_k)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    wanted = triton.next_power_of_2(triton.cdiv(4 * multiprocessors(device), tiles))
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
    res_ptr,
    SCALE_N: tl.constexpr,
    SCALE_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:  # launched while the kernel before it finishes (`pdl.py`): waits for its output first
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
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
    ok = m_ok[:, None] & n_ok[None, :]
    offs = rm[:, None] * N + rn[None, :]
    # one split: the epilogue (the residual only then); several: fp32 partials for `sum_splits`
    finish(acc, pid_k * M * N + offs, rn[None, :], ok, res_ptr, res_ptr, out_ptr, False, HAS_RESIDUAL)


def fp8_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    plan: Fp8GemmPlan | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """[residual +] x [M, K] (fp32/fp16/bf16) @ dequant(weight [N, K] fp8, scale [N/bn, K/bk])^T -> [M, N] in
    x's dtype; `residual` [M, N]."""
    m, k = x.shape
    n = weight.shape[0]
    scale_n, scale_k = block
    plan = plan or plan_fp8_gemm(m, n, k, scale_k, x.device)
    if scale_k % plan.block_k:
        raise ValueError(f"K tile {plan.block_k} does not fit the scale block {scale_k} as this kernel needs")
    x = x.contiguous()
    res = residual.contiguous() if residual is not None else x
    k_per_split = triton.cdiv(triton.cdiv(k, plan.split_k), plan.block_k) * plan.block_k
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    # one split writes the output directly; several write fp32 partials that one more kernel sums
    partial = out if plan.split_k == 1 else torch.empty(plan.split_k, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, plan.block_m), triton.cdiv(n, plan.block_n), plan.split_k)
    _fp8_gemm_kernel[grid](
        x, weight, scale, partial, m, n, k, x.stride(0), weight.stride(0), scale.stride(0), k_per_split, res,
        SCALE_N=scale_n, SCALE_K=scale_k, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k,
        IEEE=x.dtype == torch.float32, HAS_RESIDUAL=residual is not None and plan.split_k == 1,
        num_warps=plan.num_warps, num_stages=plan.num_stages, **pdl_launch(x.device),
    )  # fmt: skip
    if plan.split_k > 1:
        sum_splits(partial, out, None, res if residual is not None else None)
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


@triton.jit
def _store_quantized(x, q_ptr, s_ptr, row, first, K, stride_sm, stride_sg, GROUP: tl.constexpr, GROUPS: tl.constexpr):
    """Row `row`'s fp32 values x [GROUPS * GROUP] from group `first` on (zeros past K) stored as e4m3, each group
    scaled so that its largest magnitude maps to e4m3's 448 (an all-zero group: scale fp32's tiny), and the scales.
    The codes go through a [GROUPS, GROUP] pointer tile: Triton's coalescing gives a load the widest vector of the
    accesses of its shape that it shares a slice with, so a flat one-byte store would widen a fused norm's row load
    and reorder its sum of squares away from `fused.rms_norm`'s."""
    x = tl.reshape(x, (GROUPS, GROUP))
    scale = tl.maximum(tl.max(tl.abs(x), axis=1) / 448.0, 1.1754943508222875e-38)
    q = tl.math.div_rn(x, scale[:, None]).to(tl.float8e4nv)
    groups = first + tl.arange(0, GROUPS)
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    tl.store(q_ptr + row * K + cols, q, mask=cols < K)
    tl.store(s_ptr + row * stride_sm + groups * stride_sg, scale, mask=groups < tl.cdiv(K, GROUP))


@triton.jit
def _quantize_groups_kernel(
    x_ptr, q_ptr, s_ptr, K, stride_xm, stride_sm, stride_sg, GROUP: tl.constexpr, GROUPS: tl.constexpr
):
    """GROUPS groups of GROUP columns of one row."""
    row = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * GROUPS
    cols = first * GROUP + tl.arange(0, GROUPS * GROUP)
    x = tl.load(x_ptr + row * stride_xm + cols, mask=cols < K, other=0.0).to(tl.float32)
    _store_quantized(x, q_ptr, s_ptr, row, first, K, stride_sm, stride_sg, GROUP, GROUPS)


@triton.jit
def _rms_norm_quantize_kernel(
    x_ptr,
    w_ptr,
    q_ptr,
    s_ptr,
    K,
    eps,
    stride_sm,
    stride_sg,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One whole row (the norm sums its squares): `fused.rms_norm`'s values, rounded as it stores them."""
    if USE_PDL:  # it takes the place of the norm, a PDL kernel: it may start before its input is written
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    dtype = x_ptr.dtype.element_ty
    y = round_to(rms_norm_row(x_ptr, w_ptr, row, K, eps, dtype, BLOCK), dtype)
    _store_quantized(y, q_ptr, s_ptr, row, 0, K, stride_sm, stride_sg, GROUP, BLOCK // GROUP)


@triton.jit
def _silu_mul_quantize_kernel(
    gate_up_ptr, q_ptr, s_ptr, K, stride_sm, stride_sg, GROUP: tl.constexpr, GROUPS: tl.constexpr, USE_PDL: tl.constexpr
):
    """GROUPS groups of GROUP columns of one row: `fused.silu_mul`'s values, rounded as it stores them."""
    if USE_PDL:  # as `_rms_norm_quantize_kernel`
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * GROUPS
    cols = first * GROUP + tl.arange(0, GROUPS * GROUP)
    dtype = gate_up_ptr.dtype.element_ty
    y = round_to(silu_mul_cols(gate_up_ptr, row, cols, K, dtype), dtype)
    _store_quantized(y, q_ptr, s_ptr, row, first, K, stride_sm, stride_sg, GROUP, GROUPS)


def _quantized_rows(
    m: int, k: int, group: int, rows: int | None, column_major_scales: bool, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The unset outputs of a quantizer of m rows (see `quantize_groups`)."""
    rows = rows or m
    q = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=device)
    n_groups = triton.cdiv(k, group)
    if column_major_scales:
        return q, torch.empty(n_groups, rows, dtype=torch.float32, device=device).t()
    return q, torch.empty(rows, n_groups, dtype=torch.float32, device=device)


def _groups_per_program(group: int) -> int:
    return max(1, min(8, 1024 // group))


def quantize_groups(
    x: torch.Tensor, group: int, rows: int | None = None, column_major_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows x [M, K] as e4m3 with one fp32 scale per row and group of `group` columns ([M, ceil(K/group)]), the
    reference being `fp8_linear.quantize_activations`. `rows` (>= M) makes both outputs taller, the extra rows
    unset; `column_major_scales` writes the scales with strides (1, rows), as cuBLASLt's block-scaled GEMM reads
    them (no transposing copy)."""
    m, k = x.shape
    q, scale = _quantized_rows(m, k, group, rows, column_major_scales, x.device)
    groups = _groups_per_program(group)
    _quantize_groups_kernel[(m, triton.cdiv(k, group * groups))](
        x, q, scale, k, x.stride(0), scale.stride(0), scale.stride(1), GROUP=group, GROUPS=groups, num_warps=4
    )
    return q, scale


def rms_norm_quantize(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    group: int,
    rows: int | None = None,
    column_major_scales: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_groups(fused.rms_norm(x, weight, eps), ...)` in one kernel, bit for bit: the normalized rows
    never go through memory. x [..., K] (rows flattened); one program per row."""
    k = x.shape[-1]
    x = x.reshape(-1, k).contiguous()
    q, scale = _quantized_rows(x.shape[0], k, group, rows, column_major_scales, x.device)
    block = max(triton.next_power_of_2(k), group)  # `fused.rms_norm`'s block (and sum order) where K >= group
    _rms_norm_quantize_kernel[(x.shape[0],)](
        x, weight, q, scale, k, eps, scale.stride(0), scale.stride(1), GROUP=group, BLOCK=block,
        num_warps=rms_norm_warps(block), **pdl_launch(x.device),
    )  # fmt: skip
    return q, scale


def silu_mul_quantize(
    gate_up: torch.Tensor, group: int, rows: int | None = None, column_major_scales: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_groups(fused.silu_mul(gate_up), ...)` in one kernel, bit for bit: gate_up [..., 2K] = [gate | up]
    (rows flattened)."""
    k = gate_up.shape[-1] // 2
    flat = gate_up.reshape(-1, 2 * k).contiguous()
    q, scale = _quantized_rows(flat.shape[0], k, group, rows, column_major_scales, flat.device)
    groups = _groups_per_program(group)
    _silu_mul_quantize_kernel[(flat.shape[0], triton.cdiv(k, group * groups))](
        flat, q, scale, k, scale.stride(0), scale.stride(1), GROUP=group, GROUPS=groups, num_warps=4,
        **pdl_launch(flat.device),
    )  # fmt: skip
    return q, scale


@dataclass(frozen=True)
class W8A8Plan:
    """Input rows and weight rows per program, K splits, launch settings, and the operand order: `swap_ab`
    makes the weight rows the dot's M (the instruction's 64-row side), which few input rows cannot fill."""

    block_m: int
    block_n: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4
    swap_ab: bool = True


def plan_w8a8(m: int, n: int, k: int, scale_block_k: int, device: torch.device) -> W8A8Plan:
    """Tiles measured best on an H200 over the Qwen3 Linears at 2..256 rows: swapped operands up to 128 rows (few
    rows cannot fill the instruction's 64-row side), the usual order above; K split to fill the SMs."""
    if m <= 16:
        block_m, block_n, stages, swap = 16, 128, 6, True
    elif m <= 32:
        block_m, block_n, stages, swap = 32, 128, 4, True
    elif m <= 128:
        block_m, block_n, stages, swap = 128, 64, 4, True
    else:
        block_m, block_n, stages, swap = 64, 128, 4, False
    split = splits_to_fill(triton.cdiv(n, block_n) * triton.cdiv(m, block_m), triton.cdiv(k, scale_block_k), device)
    return W8A8Plan(block_m, block_n, split, 4, stages, swap)


@triton.jit(do_not_specialize=["M"])
def _w8a8_kernel(
    q_ptr,
    qs_ptr,
    w_ptr,
    ws_ptr,
    res_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_wn,
    stride_wsn,
    k_per_split,
    HAS_RESIDUAL: tl.constexpr,
    SPLIT: tl.constexpr,
    SCALE_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SWAP_AB: tl.constexpr,
    REREAD: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:  # as `_fp8_gemm_kernel`
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    m_tiles = tl.cdiv(M, BLOCK_M)
    pid_n = tl.program_id(0) // m_tiles  # the row tiles of one weight tile run side by side: it leaves L2 once
    pid_m = tl.program_id(0) % m_tiles
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok, m_ok = rn < N, rm < M
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    groups = tl.cdiv(K, BLOCK_K)
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):  # a K tile is one scale block of both operands
        cols = k0 + rk
        k_ok = cols < k_end
        w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + cols[None, :]
        if REREAD:  # other row tiles read this weight tile too: keep it in L2
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        else:
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0, eviction_policy="evict_first")
        q = tl.load(q_ptr + rm[:, None] * K + cols[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        ws = tl.load(ws_ptr + (rn // SCALE_N) * stride_wsn + k0 // BLOCK_K, mask=n_ok, other=0.0)
        qs = tl.load(qs_ptr + rm * groups + k0 // BLOCK_K, mask=m_ok, other=0.0)
        if SWAP_AB:
            acc += tl.dot(w, tl.trans(q)) * ws[:, None] * qs[None, :]
        else:
            acc += tl.dot(q, tl.trans(w)) * qs[:, None] * ws[None, :]
    if SWAP_AB:
        offs = rm[None, :] * N + rn[:, None]  # acc[n, m] is output row m, column n
        ok = n_ok[:, None] & m_ok[None, :]
    else:
        offs = rm[:, None] * N + rn[None, :]
        ok = m_ok[:, None] & n_ok[None, :]
    if SPLIT:
        tl.store(out_ptr + pid_k * M * N + offs, acc, mask=ok)
    else:
        finish(acc, offs, rn, ok, res_ptr, res_ptr, out_ptr, False, HAS_RESIDUAL)


def w8a8_matmul(
    q: torch.Tensor,
    q_scale: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    dtype: torch.dtype,
    plan: W8A8Plan | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """[residual +] (q * q_scale) @ dequant(weight)^T in `dtype`, on the FP8 tensor cores: q [M, K] e4m3 with
    one scale per row and block[1] columns (`quantize_groups`), weight [N, K] e4m3 with `scale` per block."""
    m, k = q.shape
    n = weight.shape[0]
    q, q_scale = q.contiguous(), q_scale.contiguous()
    plan = plan or plan_w8a8(m, n, k, block[1], q.device)
    k_per_split = triton.cdiv(triton.cdiv(k, plan.split_k), block[1]) * block[1]
    splits = triton.cdiv(k, k_per_split)
    out = torch.empty(m, n, dtype=dtype, device=q.device)
    res = residual.contiguous() if residual is not None else out
    partial = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=q.device)
    m_tiles = triton.cdiv(m, plan.block_m)
    _w8a8_kernel[(triton.cdiv(n, plan.block_n) * m_tiles, splits)](
        q, q_scale, weight, scale, res, partial, m, n, k, weight.stride(0), scale.stride(0), k_per_split,
        HAS_RESIDUAL=residual is not None, SPLIT=splits > 1, SCALE_N=block[0], BLOCK_M=plan.block_m,
        BLOCK_N=plan.block_n, BLOCK_K=block[1], SWAP_AB=plan.swap_ab, REREAD=m_tiles > 1,
        num_warps=plan.num_warps, num_stages=plan.num_stages, **pdl_launch(q.device),
    )  # fmt: skip
    if splits > 1:
        sum_splits(partial, out, None, res if residual is not None else None)
    return out


def w8a8_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int],
    plan: W8A8Plan | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """[residual +] x @ dequant(weight)^T with x quantized per row and scale block of columns first (the
    checkpoints' `activation_scheme: dynamic`), in x's dtype."""
    q, q_scale = quantize_groups(x.contiguous(), block[1])
    return w8a8_matmul(q, q_scale, weight, scale, block, x.dtype, plan, residual)


BLOCK_SCALED = (128, 128)  # the scale blocks of its operands: 1x128 for activations, 128x128 for weights


def block_scaled_supported(n: int, k: int, block: tuple[int, int], dtype: torch.dtype) -> bool:
    """Whether `block_scaled_gemm` takes the weight as stored: 128x128 blocks, bf16 output, and K/128 a multiple
    of 4 (cuBLASLt's weight scales are [K/128 padded to 4, N/128] with that stride: `weight_scale_inv` transposed
    is that view when no padding is needed, as for every Qwen3 Linear)."""
    return block == BLOCK_SCALED and dtype == torch.bfloat16 and n % 128 == 0 and k % (4 * 128) == 0


def block_scaled_matmul(
    q: torch.Tensor, q_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, rows: int
) -> torch.Tensor:
    """(q * q_scale) @ dequant(weight [N, K] e4m3, scale [N/128, K/128])^T in cuBLASLt (`torch._scaled_mm`, CUDA
    only): q [run_rows, K] e4m3 with its scales per row and 128 columns column-major (`quantize_groups(...,
    run_rows, column_major_scales=True)`: row counts cuBLASLt refuses are padded); the first `rows` rows, in
    `dtype`."""
    out = torch._scaled_mm(q, weight.t(), scale_a=q_scale, scale_b=scale.t(), out_dtype=dtype)
    return out[:rows]


def block_scaled_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, run_rows: int) -> torch.Tensor:
    """x [M, K] bf16 @ dequant(weight [N, K] e4m3, scale [N/128, K/128])^T with x quantized per row and 128 columns,
    in cuBLASLt (`block_scaled_matmul`): [M, N] bf16, computed over `run_rows` >= M rows (the extra rows are never
    read)."""
    q, q_scale = quantize_groups(x.contiguous(), BLOCK_SCALED[1], run_rows, column_major_scales=True)
    return block_scaled_matmul(q, q_scale, weight, scale, x.dtype, x.shape[0])
