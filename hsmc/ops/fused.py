"""Fused Triton kernels for the memory-bound steps around attention (RMSNorm, SiLU·mul, q/k norm + RoPE + KV write):
one kernel each instead of the 5-10 small kernels of the torch reference, which would otherwise cost a decode step
more than its weight reads. They round exactly where `TorchBackend` rounds (fp32 math, the activation dtype after
each step), so bf16 results match the reference bit for bit up to the last place of fp32 transcendentals.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hsmc.ops.pdl import pdl_launch
from hsmc.ops.tiles import round_to


@triton.jit
def rms_norm_row(x_ptr, w_ptr, row, N, eps, dtype: tl.constexpr, BLOCK: tl.constexpr):
    """RMSNorm(x) * weight over row `row`'s columns arange(BLOCK) (zeros past N) in fp32, before its last rounding
    to `dtype` (the caller's: a store or `round_to`). Shared with the quantizing norm (`fp8_gemm`), which must sum
    the squares in the same order to give the same bits."""
    cols = tl.arange(0, BLOCK)
    valid = cols < N
    x = tl.load(x_ptr + row * N + cols, mask=valid, other=0.0).to(tl.float32)
    variance = tl.sum(x * x, 0) / N
    h = round_to(x * tl.rsqrt(variance + eps), dtype)
    w = tl.load(w_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    return h * w


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, N, eps, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    dtype = out_ptr.dtype.element_ty
    y = rms_norm_row(x_ptr, w_ptr, row, N, eps, dtype, BLOCK)
    tl.store(out_ptr + row * N + cols, y.to(dtype), mask=cols < N)


def rms_norm_warps(block: int) -> int:
    """The warps of a norm over a row of `block` (a power of two) columns: they fix the order of its sum."""
    return min(16, max(1, block // 512))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of every row of x (contiguous rows), one program per row; into `out` ([rows, n], contiguous) if given."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n).contiguous()
    out = torch.empty_like(x2) if out is None else out
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(x2.shape[0],)](
        x2, weight, out, n, eps, BLOCK=block, num_warps=rms_norm_warps(block), **pdl_launch(x.device)
    )
    return out.view(x.shape)


@triton.jit
def silu_mul_cols(gate_up_ptr, row, cols, inner, dtype: tl.constexpr):
    """silu(gate) * up at columns `cols` of row `row` of [gate | up] (zeros past `inner`) in fp32, before its last
    rounding to `dtype` (the caller's); shared with the quantizing SiLU·mul (`fp8_gemm`)."""
    valid = cols < inner
    gate = tl.load(gate_up_ptr + row * 2 * inner + cols, mask=valid, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * inner + inner + cols, mask=valid, other=0.0).to(tl.float32)
    silu = round_to(gate / (1.0 + tl.exp(-gate)), dtype)
    return silu * up


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, inner, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    dtype = out_ptr.dtype.element_ty
    y = silu_mul_cols(gate_up_ptr, row, cols, inner, dtype)
    tl.store(out_ptr + row * inner + cols, y.to(dtype), mask=cols < inner)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dimension (contiguous)."""
    two_i = gate_up.shape[-1]
    flat = gate_up.reshape(-1, two_i)
    out = torch.empty(flat.shape[0], two_i // 2, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    grid = (flat.shape[0], triton.cdiv(two_i // 2, block))
    _silu_mul_kernel[grid](flat, out, two_i // 2, BLOCK=block, num_warps=4, **pdl_launch(gate_up.device))
    return out.view(*gate_up.shape[:-1], two_i // 2)


@triton.jit
def _qkv_rope_store_kernel(
    qkv_ptr,
    positions_ptr,
    slots_ptr,
    inv_freq_ptr,
    q_norm_ptr,
    k_norm_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    stride_kslot,
    stride_khead,
    rope_scale,
    eps,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF_BLOCK: tl.constexpr,
    HEADS: tl.constexpr,
    HAS_QK_NORM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """HEADS heads of one token, all q or all k (with their v): the token's rotation is computed once for them."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    token = tl.program_id(0).to(tl.int64)
    q_programs: tl.constexpr = (NUM_HEADS + HEADS - 1) // HEADS
    is_q = tl.program_id(1) < q_programs
    first = tl.where(is_q, tl.program_id(1) * HEADS, (tl.program_id(1) - q_programs) * HEADS)
    heads = first + tl.arange(0, HEADS)
    half: tl.constexpr = HEAD_DIM // 2
    width: tl.constexpr = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    dtype = q_out_ptr.dtype.element_ty
    i = tl.arange(0, HALF_BLOCK)
    valid = (heads < tl.where(is_q, NUM_HEADS, NUM_KV_HEADS))[:, None] & (i < half)[None, :]
    cols = tl.where(is_q, heads, NUM_HEADS + heads)[:, None] * HEAD_DIM + i[None, :]
    base = qkv_ptr + token * width
    x1 = tl.load(base + cols, mask=valid, other=0.0).to(tl.float32)
    x2 = tl.load(base + half + cols, mask=valid, other=0.0).to(tl.float32)
    if HAS_QK_NORM:
        variance = (tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / HEAD_DIM
        inv = tl.rsqrt(variance + eps)[:, None]
        norm_ptr = tl.where(is_q, q_norm_ptr, k_norm_ptr)
        w1 = tl.load(norm_ptr + i, mask=i < half, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(norm_ptr + half + i, mask=i < half, other=0.0).to(tl.float32)[None, :]
        x1 = round_to(round_to(x1 * inv, dtype) * w1, dtype)
        x2 = round_to(round_to(x2 * inv, dtype) * w2, dtype)
    position = tl.load(positions_ptr + token).to(tl.float32)
    angle = position * tl.load(inv_freq_ptr + i, mask=i < half, other=0.0)
    cos = round_to(tl.cos(angle) * rope_scale, dtype)[None, :]
    sin = round_to(tl.sin(angle) * rope_scale, dtype)[None, :]
    y1 = round_to(round_to(x1 * cos, dtype) + round_to(-x2 * sin, dtype), dtype).to(dtype)
    y2 = round_to(round_to(x2 * cos, dtype) + round_to(x1 * sin, dtype), dtype).to(dtype)
    if is_q:
        out = q_out_ptr + token * NUM_HEADS * HEAD_DIM + heads[:, None] * HEAD_DIM + i[None, :]
        tl.store(out, y1, mask=valid)
        tl.store(out + half, y2, mask=valid)
    else:
        slot = tl.load(slots_ptr + token)
        at = slot * stride_kslot + heads[:, None] * stride_khead + i[None, :]
        tl.store(k_cache_ptr + at, y1, mask=valid)
        tl.store(k_cache_ptr + at + half, y2, mask=valid)
        v_cols = cols + NUM_KV_HEADS * HEAD_DIM
        tl.store(v_cache_ptr + at, tl.load(base + v_cols, mask=valid, other=0.0), mask=valid)
        tl.store(v_cache_ptr + at + half, tl.load(base + half + v_cols, mask=valid, other=0.0), mask=valid)


def qkv_rope_store(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    rope_scale: float,
    write_slots: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    heads_per_program: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Per-head RMSNorm of q/k (when given), RoPE, k/v stored at `write_slots`; returns q [R, T, H, D].
    `heads_per_program`: (heads, warps) of a program, `qkv_rope_plan`'s by default."""
    r, t, _ = qkv.shape
    q = torch.empty(r, t, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    q_w, k_w, eps = qk_norm if qk_norm is not None else (inv_freq, inv_freq, 0.0)
    heads, warps = heads_per_program if heads_per_program is not None else qkv_rope_plan(r * t)
    grid = (r * t, triton.cdiv(num_heads, heads) + triton.cdiv(num_kv_heads, heads))
    _qkv_rope_store_kernel[grid](
        qkv.contiguous(), positions.contiguous(), write_slots.contiguous(), inv_freq, q_w, k_w, q, keys, values,
        keys.stride(0), keys.stride(1), rope_scale, eps,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HALF_BLOCK=triton.next_power_of_2(head_dim // 2), HEADS=heads, HAS_QK_NORM=qk_norm is not None,
        num_warps=warps, **pdl_launch(qkv.device),
    )  # fmt: skip
    return q


def qkv_rope_plan(tokens: int) -> tuple[int, int]:
    """(heads, warps) of a program. Its cost is mostly fixed (a token's position, rotation and norm weights), so
    many tokens want few programs of many heads; a few tokens want one head a program, spread over the SMs. On an
    H200, 1,152 tokens of the 32B's 80 q/k heads took 100 us at one head a program, 15 at 8 heads over 2 warps, 11
    at the copy bandwidth (docs/measurements/2026-12-01-h200-fp8-routes-and-qkv-rope.txt)."""
    if tokens <= 16:
        return 1, 1
    return (4, 2) if tokens <= 128 else (8, 2)
