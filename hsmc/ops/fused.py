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
    HAS_QK_NORM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    half: tl.constexpr = HEAD_DIM // 2
    width: tl.constexpr = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    dtype = q_out_ptr.dtype.element_ty
    i = tl.arange(0, HALF_BLOCK)
    valid = i < half
    base = qkv_ptr + token * width + head * HEAD_DIM
    x1 = tl.load(base + i, mask=valid, other=0.0).to(tl.float32)
    x2 = tl.load(base + half + i, mask=valid, other=0.0).to(tl.float32)
    if HAS_QK_NORM:
        is_q = head < NUM_HEADS
        variance = (tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / HEAD_DIM
        inv = tl.rsqrt(variance + eps)
        w1 = tl.where(
            is_q, tl.load(q_norm_ptr + i, mask=valid, other=0.0), tl.load(k_norm_ptr + i, mask=valid, other=0.0)
        )
        w2 = tl.where(
            is_q,
            tl.load(q_norm_ptr + half + i, mask=valid, other=0.0),
            tl.load(k_norm_ptr + half + i, mask=valid, other=0.0),
        )
        w1, w2 = w1.to(tl.float32), w2.to(tl.float32)
        x1 = round_to(round_to(x1 * inv, dtype) * w1, dtype)
        x2 = round_to(round_to(x2 * inv, dtype) * w2, dtype)
    position = tl.load(positions_ptr + token).to(tl.float32)
    angle = position * tl.load(inv_freq_ptr + i, mask=valid, other=0.0)
    cos = round_to(tl.cos(angle) * rope_scale, dtype)
    sin = round_to(tl.sin(angle) * rope_scale, dtype)
    y1 = round_to(round_to(x1 * cos, dtype) + round_to(-x2 * sin, dtype), dtype)
    y2 = round_to(round_to(x2 * cos, dtype) + round_to(x1 * sin, dtype), dtype)
    if head < NUM_HEADS:
        out = q_out_ptr + (token * NUM_HEADS + head) * HEAD_DIM
        tl.store(out + i, y1.to(dtype), mask=valid)
        tl.store(out + half + i, y2.to(dtype), mask=valid)
    else:
        kv_head = head - NUM_HEADS
        slot = tl.load(slots_ptr + token)
        k_out = k_cache_ptr + slot * stride_kslot + kv_head * stride_khead
        tl.store(k_out + i, y1.to(dtype), mask=valid)
        tl.store(k_out + half + i, y2.to(dtype), mask=valid)
        v_base = qkv_ptr + token * width + (NUM_HEADS + NUM_KV_HEADS + kv_head) * HEAD_DIM
        v_out = v_cache_ptr + slot * stride_kslot + kv_head * stride_khead
        tl.store(v_out + i, tl.load(v_base + i, mask=valid, other=0.0), mask=valid)
        tl.store(v_out + half + i, tl.load(v_base + half + i, mask=valid, other=0.0), mask=valid)


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
) -> torch.Tensor:
    """Per-head RMSNorm of q/k (when given), RoPE, k/v stored at `write_slots`; returns q [R, T, H, D]."""
    r, t, _ = qkv.shape
    q = torch.empty(r, t, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    q_w, k_w, eps = qk_norm if qk_norm is not None else (inv_freq, inv_freq, 0.0)
    _qkv_rope_store_kernel[(r * t, num_heads + num_kv_heads)](
        qkv.contiguous(), positions.contiguous(), write_slots.contiguous(), inv_freq, q_w, k_w, q, keys, values,
        keys.stride(0), keys.stride(1), rope_scale, eps,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        HALF_BLOCK=triton.next_power_of_2(head_dim // 2), HAS_QK_NORM=qk_norm is not None, num_warps=1,
        **pdl_launch(qkv.device),
    )  # fmt: skip
    return q
