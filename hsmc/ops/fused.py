"""Fused Triton kernels for the memory-bound steps around attention, one kernel each instead of the
5-10 small kernels the torch reference launches per step (a decode step of a 36-layer model would
otherwise spend more time launching elementwise kernels than reading weights).

Each kernel reproduces the reference's rounding: values are computed in fp32 and rounded to the
activation dtype exactly where `TorchBackend` rounds (after the residual add, after normalizing,
after scaling by the weight, after each RoPE product), so bf16 outputs agree with the reference
bit for bit except where fp32 transcendental functions differ in the last place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _round(x, dtype: tl.constexpr):
    """Round fp32 values to `dtype` and back, as a torch op producing `dtype` would."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    stream_ptr,
    N,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    valid = cols < N
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * N + cols, mask=valid, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x = _round(x + tl.load(res_ptr + row * N + cols, mask=valid, other=0.0).to(tl.float32), dtype)
        tl.store(stream_ptr + row * N + cols, x.to(dtype), mask=valid)
    variance = tl.sum(x * x, 0) / N
    h = _round(x * tl.rsqrt(variance + eps), dtype)
    w = tl.load(w_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + cols, (h * w).to(dtype), mask=valid)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass; without a residual, (rms_norm(x), x)."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    out = torch.empty_like(x2)
    stream = torch.empty_like(x2) if residual is not None else x2
    res = residual.reshape(-1, n) if residual is not None else x2
    block = triton.next_power_of_2(n)
    _add_rms_norm_kernel[(x2.shape[0],)](
        x2, res, weight, out, stream, n, eps, HAS_RESIDUAL=residual is not None, BLOCK=block,
        num_warps=min(16, max(1, block // 512)),
    )  # fmt: skip
    return out.view(x.shape), stream.view(x.shape)


@triton.jit
def _norm_gemv_kernel(
    x_ptr,
    res_ptr,
    norm_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    stream_ptr,
    M,
    N,
    K,
    stride_wn,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid = tl.program_id(0)
    dtype = out_ptr.dtype.element_ty
    m = tl.arange(0, BLOCK_M)
    m_valid = m < M
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_valid = n < N
    # pass 1: each row's RMS over the stream s = x + residual (rounded like the reference's add)
    sumsq = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        mask = m_valid[:, None] & (k < K)[None, :]
        s = tl.load(x_ptr + m[:, None] * K + k[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            s = _round(s + tl.load(res_ptr + m[:, None] * K + k[None, :], mask=mask, other=0.0).to(tl.float32), dtype)
            if pid == 0:
                tl.store(stream_ptr + m[:, None] * K + k[None, :], s.to(dtype), mask=mask)
        sumsq += tl.sum(s * s, 1)
    inv = tl.rsqrt(sumsq / K + eps)
    # pass 2: the normalized rows times this program's slab of W, streamed once
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_valid = k < K
        mask = m_valid[:, None] & k_valid[None, :]
        s = tl.load(x_ptr + m[:, None] * K + k[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            s = _round(s + tl.load(res_ptr + m[:, None] * K + k[None, :], mask=mask, other=0.0).to(tl.float32), dtype)
        g = tl.load(norm_ptr + k, mask=k_valid, other=0.0).to(tl.float32)
        h = _round(_round(s * inv[:, None], dtype) * g[None, :], dtype)
        w = tl.load(w_ptr + n[:, None] * stride_wn + k[None, :], mask=n_valid[:, None] & k_valid[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(h.to(w.dtype), tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(h.to(w.dtype), tl.trans(w))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n_valid, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + m[:, None] * N + n[None, :], acc.to(dtype), mask=m_valid[:, None] & n_valid[None, :])


def norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    sm_count: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(rms_norm(x + residual)), x + residual) for at most 16 rows: the decode-time matmul that
    reads the weight once, with the norm (and residual add) computed in its prologue instead of a kernel of
    its own. Each program streams a [BLOCK_N, K] slab of the weight; enough programs to fill the GPU."""
    k = x.shape[-1]
    n = weight.shape[0]
    x2 = x.reshape(-1, k)
    rows = x2.shape[0]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    stream = torch.empty_like(x2) if residual is not None else x2
    res = residual.reshape(-1, k) if residual is not None else x2
    per_program = max(1, n // (2 * sm_count))  # rows of W per program for two waves of programs
    block_n = max(16, min(64, 1 << (per_program.bit_length() - 1)))
    block_k = 256 if block_n == 16 else 128
    _norm_gemv_kernel[(triton.cdiv(n, block_n),)](
        x2, res, norm_weight, weight, bias if bias is not None else weight, out, stream, rows, n, k,
        weight.stride(0), eps, HAS_RESIDUAL=residual is not None, HAS_BIAS=bias is not None,
        BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=x.dtype == torch.float32, num_warps=4, num_stages=4,
    )  # fmt: skip
    return out.view(*x.shape[:-1], n), stream.view(x.shape)


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, inner, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = cols < inner
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(gate_up_ptr + row * 2 * inner + cols, mask=valid, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * inner + inner + cols, mask=valid, other=0.0).to(tl.float32)
    silu = _round(gate / (1.0 + tl.exp(-gate)), dtype)
    tl.store(out_ptr + row * inner + cols, (silu * up).to(dtype), mask=valid)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dimension (contiguous)."""
    two_i = gate_up.shape[-1]
    flat = gate_up.reshape(-1, two_i)
    out = torch.empty(flat.shape[0], two_i // 2, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(flat.shape[0], triton.cdiv(two_i // 2, block))](flat, out, two_i // 2, BLOCK=block, num_warps=4)
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
):
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
        x1 = _round(_round(x1 * inv, dtype) * w1, dtype)
        x2 = _round(_round(x2 * inv, dtype) * w2, dtype)
    position = tl.load(positions_ptr + token).to(tl.float32)
    angle = position * tl.load(inv_freq_ptr + i, mask=valid, other=0.0)
    cos = _round(tl.cos(angle) * rope_scale, dtype)
    sin = _round(tl.sin(angle) * rope_scale, dtype)
    y1 = _round(_round(x1 * cos, dtype) + _round(-x2 * sin, dtype), dtype)
    y2 = _round(_round(x2 * cos, dtype) + _round(x1 * sin, dtype), dtype)
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
    )  # fmt: skip
    return q
