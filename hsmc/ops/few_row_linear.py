"""The Linears of a forward of a few rows (2..32: batch-2..32 decode, the particles of an SMC proposal step, the
verify of a rejection round over a few rows), chained by programmatic dependent launch like the one-row kernel
(`decode_linear.py`), on the tensor cores.

A few rows still read each weight once and do little arithmetic, so a Linear lasts its weight bytes over the
bandwidth plus what leaves the memory idle. The one-row kernel's elementwise products cost M times the
instructions at M rows (30 % of the copy bandwidth at 8 rows), so here the products run on the tensor cores
with the operands swapped: the weight [N, K] (row-major) is the dot's left operand, a program streams
[BLOCK_N, BLOCK_K] tiles of it, pipelined by Triton through shared memory, and multiplies each with the rows'
input tile transposed, [BLOCK_K, 16] (the rows padded to 16 with zeros, the smallest tile of the
instruction; 17..32 rows: 32), into an fp32 [BLOCK_N, 16 or 32] accumulator: the padding costs no weight bytes.

The epilogue (bias, the residual add that makes the next stream) is inside; the first weight tile loads
before `gdc_wait` (up to 9 % faster than after it). The RMSNorm / SiLU·mul before the Linear runs as its own
PDL-chained kernel (`fused.py`): inside, every program repeats it for its rows, and it measured 1.2-3.6x
slower. Matrices with too few row tiles to fill the GPU split K over programs that write fp32 partials,
summed by one small kernel that runs the epilogue. Rounding follows the torch reference (`TorchBackend`):
the output rounded, then the residual added. Measured on an H200, the Qwen3-8B Linears of all 36 layers
chained read at 81-83 % of the copy bandwidth at 2..16 rows (cuBLAS after the same norm / SiLU kernels:
73-77 %); tried and slower: loading the next tile into registers instead of Triton's pipelining, 64- and
128-row tiles with 4-8 warps, splitting K where the row tiles fill the SMs. Past 16 rows the kernel beats
cuBLAS only with settings measured for that GPU and 4 warps (the 8B step at 24-32 rows 2.2-2.5 % faster on an
H200, 4.2 % on an H100; with the 16-row settings 4-5 % slower on an H200), so 17..32 rows take it only where
`MEASURED_PLANS` has a 32-row plan for the weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import triton
import triton.language as tl

from hsmc.ops import fused
from hsmc.ops.pdl import pdl_launch
from hsmc.ops.split_k import finish, splits_to_fill, sum_splits
from hsmc.ops.tiles import weight_tile

MAX_ROWS = 32  # rows padded to a tile of 16 or 32; more rows run cuBLAS


@dataclass(frozen=True)
class FewRowPlan:
    """Weight rows per program, K tile, K splits (1: the kernel writes the output itself), warps, and the
    weight tiles Triton keeps in flight through shared memory."""

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 2
    num_stages: int = 4


# Per GPU model, weight shape [N, K] and row tile (16: 2..16 rows, 32: 17..32): the fastest setting of
# `scripts/sweep_kernels.py --parts few-row` (each of a Linear kind's layers chained at 8 or 32 rows, the median
# of interleaved rounds). A 16-row entry replaces the default plan; a 32-row entry exists only where it beat cuBLAS,
# and only those shapes take the kernel at 17..32 rows. Other GPUs and shapes: the default, cuBLAS past 16 rows.
MEASURED_PLANS: dict[str, dict[tuple[int, int, int], FewRowPlan]] = {
    "NVIDIA H200": {  # 2026-11-26: the 8B step 1.5-1.9 % faster at 2..16 rows, 2.2-2.5 % at 24-32 rows (vs cuBLAS)
        (6144, 4096, 16): FewRowPlan(32, 128, 1, 2, 6),  # Qwen3-8B q/k/v
        (4096, 4096, 16): FewRowPlan(64, 128, 1, 4, 8),  # o
        (24576, 4096, 16): FewRowPlan(64, 128, 1, 2, 4),  # gate/up
        (4096, 12288, 16): FewRowPlan(32, 128, 1, 2, 8),  # down
        (151936, 4096, 16): FewRowPlan(32, 256, 1, 2, 3),  # LM head
        (6144, 4096, 32): FewRowPlan(64, 128, 1, 4, 6),
        (4096, 4096, 32): FewRowPlan(64, 128, 1, 4, 6),
        (24576, 4096, 32): FewRowPlan(64, 128, 1, 2, 4),
        (4096, 12288, 32): FewRowPlan(64, 128, 1, 4, 8),
        (151936, 4096, 32): FewRowPlan(64, 64, 1, 4, 8),
    },
    "NVIDIA H100 80GB HBM3": {  # 2026-11-26: the 8B step 1.1-1.2 % faster at 2..16 rows, 4.2 % at 24-32 (vs cuBLAS)
        (6144, 4096, 16): FewRowPlan(32, 128, 1, 2, 6),  # Qwen3-8B q/k/v
        (4096, 4096, 16): FewRowPlan(64, 128, 1, 4, 6),  # o
        (24576, 4096, 16): FewRowPlan(32, 128, 1, 2, 6),  # gate/up
        (4096, 12288, 16): FewRowPlan(32, 128, 1, 2, 8),  # down
        (151936, 4096, 16): FewRowPlan(32, 256, 1, 2, 5),  # LM head
        (6144, 4096, 32): FewRowPlan(64, 128, 1, 4, 6),
        (4096, 4096, 32): FewRowPlan(64, 128, 1, 4, 6),
        (24576, 4096, 32): FewRowPlan(64, 128, 1, 4, 6),
        (4096, 12288, 32): FewRowPlan(64, 128, 1, 4, 6),
        (151936, 4096, 32): FewRowPlan(64, 128, 1, 4, 6),
    },
}


@cache
def gpu_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def row_tile(rows: int) -> int:
    """The rows padded to the kernel's row tile (the dot's smallest is 16)."""
    return 16 if rows <= 16 else 32


def measured_plan(n: int, k: int, rows: int, device: torch.device) -> FewRowPlan | None:
    return MEASURED_PLANS.get(gpu_name(device), {}).get((n, k, row_tile(rows)))


def plan_few_row_linear(n: int, k: int, rows: int, device: torch.device) -> FewRowPlan:
    """A measured plan for this GPU, shape and row tile, else 32 weight rows x 256 columns per tile, 2 warps, 4 tiles
    in flight: within 3.5 % of each Qwen3-8B / 32B matrix's best at 8 rows on an H200 (`--sections fewlinears`). K
    is split while the row tiles would leave SMs idle (`splits_to_fill`)."""
    measured = measured_plan(n, k, rows, device)
    return measured or FewRowPlan(32, 256, splits_to_fill(triton.cdiv(n, 32), triton.cdiv(k, 256), device))


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
    """[residual +] (prologue(x) @ weight^T [+ bias]) for up to 16 rows x [..., K] (or [..., 2K] = [gate | up]
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
    plan = plan or plan_few_row_linear(n, k, m, x.device)
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
