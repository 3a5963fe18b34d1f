"""The Linears of a forward of 2..32 rows (batch-2..32 decode, SMC proposal steps, small verifies), on the tensor
cores and chained by programmatic dependent launch.

A few rows still read each weight once, so the weight read is the cost. The operands are swapped so that the
weight [N, K] is the dot's left operand and the rows, padded with zeros to the instruction's 16 (or 32), its right:
the padding costs no weight bytes. The bias and residual add run in the epilogue; the RMSNorm / SiLU·mul before
the Linear is its own PDL-chained kernel (repeating it in every program measured slower). Matrices with too few
row tiles to fill the GPU split K (`split_k.py`). Rounding follows `TorchBackend`. Which rows take this kernel,
and with which plan, is the router's choice (`linear_router.py`); the measurements are in
docs/measurements/2026-11-27-ops-notes.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hsmc.ops import fused
from hsmc.ops.pdl import pdl_launch
from hsmc.ops.split_k import finish, splits_to_fill, sum_splits
from hsmc.ops.tiles import weight_tile

MAX_ROWS = 32  # rows padded to a tile of 16 or 32; more rows run a GEMM


@dataclass(frozen=True)
class FewRowPlan:
    """Weight rows per program, K tile, K splits (1: the kernel writes the output itself), warps, and the
    weight tiles Triton keeps in flight through shared memory."""

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 2
    num_stages: int = 4


def row_tile(rows: int) -> int:
    """The rows padded to the kernel's row tile (the dot's smallest is 16)."""
    return 16 if rows <= 16 else 32


def default_few_row_plan(n: int, k: int, device: torch.device) -> FewRowPlan:
    """32 weight rows x 256 columns per tile, 2 warps, 4 tiles in flight (within a few % of each Qwen3 matrix's
    best at 8 rows on an H200), K split while the row tiles would leave SMs idle."""
    return FewRowPlan(32, 256, splits_to_fill(triton.cdiv(n, 32), triton.cdiv(k, 256), device))


@triton.jit
def _dot(w, x, acc, IEEE: tl.constexpr):
    """acc + w [BLOCK_N, BLOCK_K] @ x^T: fp32 operands multiply exactly (`ieee`), as the reference does."""
    if IEEE:
        return tl.dot(w, tl.trans(x), acc, input_precision="ieee")
    return tl.dot(w, tl.trans(x), acc)


@triton.jit
def _input_tile(x_ptr, rm, m_ok, cols, k_end, stride_xm):
    """The rows' input at columns `cols`, [BLOCK_M, BLOCK_K] (zero rows past M, zeros past the split's end)."""
    ok = m_ok[:, None] & (cols < k_end)[None, :]
    return tl.load(x_ptr + rm[:, None] * stride_xm + cols[None, :], mask=ok, other=0.0)


@triton.jit(do_not_specialize=["M"])
def _few_row_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    res_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    k_per_split,
    HAS_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rm = tl.arange(0, BLOCK_M)
    m_ok = rm < M
    rk = tl.arange(0, BLOCK_K)
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn
    w = weight_tile(w_rows, n_ok, k_begin + rk, k_end)  # weights are never written: loaded before the wait
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc = _dot(w, _input_tile(x_ptr, rm, m_ok, k_begin + rk, k_end, stride_xm), acc, IEEE)
    for k0 in range(k_begin + BLOCK_K, k_end, BLOCK_K):  # Triton pipelines these tiles through shared memory
        w = weight_tile(w_rows, n_ok, k0 + rk, k_end)
        acc = _dot(w, _input_tile(x_ptr, rm, m_ok, k0 + rk, k_end, stride_xm), acc, IEEE)

    offs = rm[None, :] * N + rn[:, None]  # acc[n, m] is output row m, column n
    ok = n_ok[:, None] & m_ok[None, :]
    if SPLIT:
        tl.store(out_ptr + pid_k * M * N + offs, acc, mask=ok)
    else:
        finish(acc, offs, rn[:, None], ok, bias_ptr, res_ptr, out_ptr, HAS_BIAS, HAS_RESIDUAL)


def few_row_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    norm: tuple[torch.Tensor, float] | None = None,
    silu_mul: bool = False,
    residual: torch.Tensor | None = None,
    plan: FewRowPlan | None = None,
) -> torch.Tensor:
    """[residual +] (prologue(x) @ weight^T [+ bias]) for up to 32 rows x [..., K] (or [..., 2K] = [gate | up]
    with `silu_mul`; rows may be strided); the prologue, RMSNorm with `norm` = (weight, eps) or SiLU·mul, runs
    as its own kernel first. `weight` [N, K] in x's dtype (bf16, fp16 or fp32)."""
    n, k = weight.shape
    rows = x.reshape(-1, x.shape[-1])
    m = rows.shape[0]
    if m > MAX_ROWS or rows.shape[1] != (2 * k if silu_mul else k):
        raise ValueError(f"few_row_linear takes <= {MAX_ROWS} rows of {2 * k if silu_mul else k}, got {tuple(x.shape)}")
    if norm is not None:
        rows = fused.rms_norm(rows, *norm)
    elif silu_mul:
        rows = fused.silu_mul(rows.contiguous())
    elif rows.stride(1) != 1:
        rows = rows.contiguous()
    plan = plan or default_few_row_plan(n, k, x.device)
    k_per_split = triton.cdiv(triton.cdiv(k, plan.split_k), plan.block_k) * plan.block_k
    splits = triton.cdiv(k, k_per_split)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    res = residual.reshape(m, n).contiguous() if residual is not None else out
    partial = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    _few_row_kernel[(triton.cdiv(n, plan.block_n), splits)](
        rows, weight, bias if bias is not None else weight, res, partial, m, n, k, rows.stride(0), weight.stride(0),
        k_per_split, HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, SPLIT=splits > 1,
        BLOCK_M=row_tile(m), BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, IEEE=x.dtype == torch.float32,
        num_warps=plan.num_warps, num_stages=plan.num_stages, **pdl_launch(x.device),
    )  # fmt: skip
    if splits > 1:
        sum_splits(partial, out, bias, res if residual is not None else None)
    return out.view(*x.shape[:-1], n)
