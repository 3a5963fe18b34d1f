"""The Linears of a one-row forward (batch-1 decode), fused with what surrounds them and chained with
programmatic dependent launch (PDL).

At one row a Linear reads its weight once and does almost no arithmetic, so a decode step lasts its
weight bytes over the memory bandwidth plus whatever leaves the memory idle: the gap between kernels,
each kernel's ramp-up and tail, and the small kernels between the matmuls (RMSNorm, SiLU·mul, residual
add). One kernel here is a Linear with
- a prologue: none, the RMSNorm of the residual stream (before q/k/v, gate/up and the LM head), or
  SiLU(gate)·up (before down);
- an epilogue: the bias, and the residual add that makes the next stream (after o and down);
so a decoder layer is four of these around RoPE and attention, and no separate norm, SiLU or add kernel.

With programmatic dependent launch (`pdl.py`) a kernel is launched while the previous one still runs: its
programs load their first weight tile, which no kernel of a forward writes, then wait for the previous
kernel's output and let the next kernel launch. That hides the launch gap and the ramp-up of each matmul
behind the tail of the last.

A program streams BLOCK_N weight rows in K tiles, the next tile loading while this one is multiplied.
bf16/fp16/fp32 weights accumulate elementwise and reduce once at the end; block-scaled FP8 weights (Qwen's
layout, read as stored) reduce each scale block of a tile, scale it and accumulate, which keeps the
registers free for tiles as long as bf16's. More rows use tensor-core GEMMs (cuBLAS, `fp8_gemm`): a
tensor-core version of this kernel measured 3x slower than cuBLAS at 8-16 rows.
Rounding follows the torch reference (`TorchBackend`): normalized values, SiLU and its product rounded
where it rounds them, and the Linear's output rounded before the residual is added.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hsmc.ops import fused
from hsmc.ops.pdl import pdl_launch

NO_PROLOGUE, RMS_NORM, SILU_MUL = 0, 1, 2
ELEMENTWISE, ROWS, SCALE_BLOCKS = 0, 1, 2  # how a program sums its products (DecodeLinearPlan.reduce)


@dataclass(frozen=True)
class DecodeLinearPlan:
    """Weight rows per program, K tile, how products are summed, and launch settings of one problem.

    reduce: ELEMENTWISE keeps a [rows, K tile] fp32 sum and reduces once at the end (fewest instructions,
    most registers); ROWS reduces every tile to one sum per row; SCALE_BLOCKS (FP8) sums each scale block
    of a tile, then scales. ELEMENTWISE and ROWS fold FP8 scales into the input. `num_stages` 1 loads the
    next tile into registers while this one is multiplied; more stages let Triton pipeline the loads
    through shared memory. `l2_prefetch` asks L2 for the program's whole weight slice before waiting on the
    previous kernel. `fuse_prologue` False runs the norm / SiLU·mul as its own (PDL-chained) kernel, so
    the matmul's programs do not repeat it per tile.
    """

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 1
    reduce: int = ELEMENTWISE
    fuse_prologue: bool = True
    l2_prefetch: bool = False


def plan_decode_linear(n: int, k: int, scale_block_k: int | None) -> DecodeLinearPlan:
    """Settings measured on the GPU over the Qwen3-8B / 32B Linears (`scripts/gpu_engine_check.py --sections
    linears` sweeps them)."""
    if scale_block_k is None:
        return DecodeLinearPlan(8, 1024)
    return DecodeLinearPlan(8, max(scale_block_k, 1024 // scale_block_k * scale_block_k), reduce=SCALE_BLOCKS)


@triton.jit
def _round(x, dtype: tl.constexpr):
    """Round fp32 values to `dtype` and back, as a torch op producing `dtype` would."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def _input_tile(x_ptr, cols, ok, K, inv, norm_ptr, PROLOGUE: tl.constexpr, dtype: tl.constexpr):
    """Columns `cols` of the Linear's input after the prologue, fp32 [BLOCK_K]."""
    if PROLOGUE == 2:  # the row is [gate | up]
        gate = tl.load(x_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + K + cols, mask=ok, other=0.0).to(tl.float32)
        return _round(_round(gate / (1.0 + tl.exp(-gate)), dtype) * up, dtype)
    x = tl.load(x_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if PROLOGUE == 1:
        w = tl.load(norm_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        x = _round(_round(x * inv, dtype) * w, dtype)
    return x


@triton.jit
def _prefetch_l2(w_ptr, rn, N, K, stride_wn, BLOCK_K: tl.constexpr, LINE: tl.constexpr):
    """Ask L2 for weight rows `rn` (every 128-byte line, LINE elements each) without waiting for them."""
    rows = w_ptr + tl.minimum(rn, N - 1)[:, None].to(tl.int64) * stride_wn
    lines = tl.arange(0, BLOCK_K // LINE) * LINE
    for k0 in range(0, K, BLOCK_K):
        addr = rows + tl.minimum(k0 + lines, K - 1)[None, :]
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [addr], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _accumulate(acc, w, x, s, BLOCK_N: tl.constexpr, SCALE_K: tl.constexpr, REDUCE: tl.constexpr, FP8: tl.constexpr):
    """acc + the products of one tile (x already carries the FP8 scales unless REDUCE is SCALE_BLOCKS)."""
    if REDUCE == 0:
        acc += w.to(tl.float32) * x[None, :]
    elif REDUCE == 1:
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    else:
        blocks: tl.constexpr = x.shape[0] // SCALE_K
        per_block = tl.sum(tl.reshape(w.to(tl.float32) * x[None, :], (BLOCK_N, blocks, SCALE_K)), axis=2)
        acc += tl.sum(per_block * s[None, :], axis=1)
    return acc


@triton.jit
def _tile_scales(s_row, k0, K, BLOCK_K: tl.constexpr, SCALE_K: tl.constexpr, REDUCE: tl.constexpr):
    """FP8 scales of the K tile at k0: one per scale block (SCALE_BLOCKS), else one per column."""
    if REDUCE == 2:
        b = k0 // SCALE_K + tl.arange(0, BLOCK_K // SCALE_K)
        return tl.load(s_row + b, mask=b * SCALE_K < K, other=0.0)
    cols = k0 + tl.arange(0, BLOCK_K)
    return tl.load(s_row + cols // SCALE_K, mask=cols < K, other=0.0)


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
    REDUCE: tl.constexpr,
    STAGES: tl.constexpr,
    L2_PREFETCH: tl.constexpr,
    LINE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    dtype = out_ptr.dtype.element_ty
    rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn
    s_row = s_ptr + (pid * BLOCK_N // SCALE_N) * stride_sn  # FP8: a program's rows share one scale row

    # weights (and scales) are never written during a forward: they may load before the wait
    if L2_PREFETCH:
        _prefetch_l2(w_ptr, rn, N, K, stride_wn, BLOCK_K, LINE)
    if STAGES == 1:
        w = tl.load(w_rows + rk[None, :], mask=n_ok[:, None] & (rk < K)[None, :], other=0.0, eviction_policy="evict_first")
        s = _tile_scales(s_row, 0, K, BLOCK_K, SCALE_K, REDUCE) if FP8 else 0.0
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

    if REDUCE == 0:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    if STAGES == 1:  # the next tile loads into registers while this one is multiplied
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + rk
            next_cols = cols + BLOCK_K
            w_next = tl.load(
                w_rows + next_cols[None, :],
                mask=n_ok[:, None] & (next_cols < K)[None, :],
                other=0.0,
                eviction_policy="evict_first",
            )
            x = _input_tile(x_ptr, cols, cols < K, K, inv, norm_ptr, PROLOGUE, dtype)
            if FP8:
                s_next = _tile_scales(s_row, k0 + BLOCK_K, K, BLOCK_K, SCALE_K, REDUCE)
                if REDUCE != 2:
                    x = x * s
            acc = _accumulate(acc, w, x, s, BLOCK_N, SCALE_K, REDUCE, FP8)
            w = w_next
            if FP8:
                s = s_next
    else:  # Triton pipelines the loads through shared memory
        for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
            cols = k0 + rk
            w = tl.load(
                w_rows + cols[None, :], mask=n_ok[:, None] & (cols < K)[None, :], other=0.0, eviction_policy="evict_first"
            )
            x = _input_tile(x_ptr, cols, cols < K, K, inv, norm_ptr, PROLOGUE, dtype)
            s = 0.0
            if FP8:
                s = _tile_scales(s_row, k0, K, BLOCK_K, SCALE_K, REDUCE)
                if REDUCE != 2:
                    x = x * s
            acc = _accumulate(acc, w, x, s, BLOCK_N, SCALE_K, REDUCE, FP8)

    if REDUCE == 0:
        y = tl.sum(acc, 1)
    else:
        y = acc
    if HAS_BIAS:
        y += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        y = _round(y, dtype) + tl.load(res_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
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
    plan = plan or plan_decode_linear(n, k, scale_k if fp8 else None)
    if fp8 and (scale_n % plan.block_n or (plan.reduce == SCALE_BLOCKS and plan.block_k % scale_k)):
        raise ValueError(f"tile {plan.block_n}x{plan.block_k} does not fit the fp8 scale block {scale_block}")
    if not plan.fuse_prologue and (norm is not None or silu_mul):
        x = fused.rms_norm(x, *norm) if norm is not None else fused.silu_mul(x)
        norm, silu_mul = None, False
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    _decode_linear_kernel[(triton.cdiv(n, plan.block_n),)](
        x.contiguous(), weight, scale if fp8 else weight, bias if bias is not None else weight,
        norm[0] if norm is not None else weight, residual.contiguous() if residual is not None else out, out,
        n, k, weight.stride(0), scale.stride(0) if fp8 else 0, norm[1] if norm is not None else 0.0,
        PROLOGUE=SILU_MUL if silu_mul else (RMS_NORM if norm is not None else NO_PROLOGUE),
        HAS_BIAS=bias is not None, HAS_RESIDUAL=residual is not None, FP8=fp8, SCALE_N=scale_n, SCALE_K=scale_k,
        BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, REDUCE=plan.reduce, STAGES=plan.num_stages,
        L2_PREFETCH=plan.l2_prefetch and x.is_cuda, LINE=min(plan.block_k, 128 // weight.element_size()),
        num_warps=plan.num_warps, **pdl_launch(x.device),
    )  # fmt: skip
    return out
