"""Paged attention in Triton over page-size-1 block tables (decode, verify and prefill chunks alike).

A program takes one row, one KV head, a block of query tokens and one split of the context; its query tile holds
the G query heads sharing the KV head (GQA), so each key/value block is read once for all of them. Causality is by
column, or an explicit bool mask [R, T, L] (the EAGLE3 training-time test; draft trees later). Long rows split
along the context (flash-decoding) with a combining kernel. Softmax in fp32; fp32 models use IEEE dots so they
match the reference exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hsmc.ops.pdl import pdl_launch


@triton.jit
def _attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    rows_ptr,
    start_ptr,
    num_new_ptr,
    mask_ptr,
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    stride_qr,
    stride_qt,
    stride_qh,
    stride_kslot,
    stride_khead,
    stride_table,
    stride_or,
    stride_ot,
    stride_oh,
    stride_mr,
    stride_mt,
    num_rows,
    T,
    scale_log2,
    GROUP: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    SPLITS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    IEEE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_qb = tl.cdiv(T, BLOCK_T)
    r = pid // num_qb
    qb = pid % num_qb
    row = tl.load(rows_ptr + r)
    start = tl.load(start_ptr + r)
    num_new = tl.load(num_new_ptr + r)
    last_new = tl.maximum(num_new - 1, 0)

    m = tl.arange(0, BLOCK_M)
    t = qb * BLOCK_T + m // GROUP
    head = kv_head * GROUP + m % GROUP
    m_valid = (m < BLOCK_T * GROUP) & (t < T)
    q_col = start + tl.minimum(t, last_new)
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM
    q = tl.load(
        q_ptr + r * stride_qr + t[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=m_valid[:, None] & d_valid[None, :],
        other=0.0,
    )

    if HAS_MASK:
        kv_end = start + num_new
    else:
        t_last = tl.minimum(qb * BLOCK_T + BLOCK_T - 1, T - 1)
        kv_end = start + tl.minimum(t_last, last_new) + 1
    chunk = tl.cdiv(tl.cdiv(kv_end, SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, kv_end)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for k0 in range(lo, hi, BLOCK_N):
        cols = k0 + tl.arange(0, BLOCK_N)
        c_valid = cols < hi
        slots = tl.load(table_ptr + row * stride_table + cols, mask=c_valid, other=0)
        kv_offsets = slots[:, None] * stride_kslot + kv_head * stride_khead + d[None, :]
        kv_mask = c_valid[:, None] & d_valid[None, :]
        k = tl.load(k_ptr + kv_offsets, mask=kv_mask, other=0.0)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale_log2
        if HAS_MASK:
            seen = tl.load(
                mask_ptr + r * stride_mr + t[:, None] * stride_mt + cols[None, :],
                mask=m_valid[:, None] & c_valid[None, :],
                other=0,
            )
            allowed = c_valid[None, :] & (seen != 0)
        else:
            allowed = c_valid[None, :] & (cols[None, :] <= q_col[:, None])
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv_offsets, mask=kv_mask, other=0.0)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + r * stride_or + t[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=m_valid[:, None] & d_valid[None, :],
        )
    else:
        # partials [SPLITS, R, T, H, D] and [SPLITS, R, T, H, 2], contiguous
        base = ((split * num_rows + r) * T + t) * NUM_HEADS + head
        tl.store(part_acc_ptr + base[:, None] * HEAD_DIM + d[None, :], acc, mask=m_valid[:, None] & d_valid[None, :])
        tl.store(part_ml_ptr + base * 2, m_i, mask=m_valid)
        tl.store(part_ml_ptr + base * 2 + 1, l_i, mask=m_valid)


@triton.jit
def _combine_kernel(
    part_acc_ptr,
    part_ml_ptr,
    out_ptr,
    stride_or,
    stride_ot,
    stride_oh,
    num_rows,
    T,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLITS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    head = tl.program_id(1)
    r = pid // T
    t = pid % T
    s = tl.arange(0, SPLITS)
    base = ((s * num_rows + r) * T + t) * NUM_HEADS + head
    m_s = tl.load(part_ml_ptr + base * 2)
    l_s = tl.load(part_ml_ptr + base * 2 + 1)
    m_max = tl.max(m_s, 0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m_s - m_safe)
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM
    acc = tl.load(part_acc_ptr + base[:, None] * HEAD_DIM + d[None, :], mask=d_valid[None, :], other=0.0)
    total = tl.sum(acc * w[:, None], 0)
    denom = tl.sum(l_s * w, 0)
    out = total / tl.where(denom > 0, denom, 1.0)
    tl.store(
        out_ptr + r * stride_or + t * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_valid
    )


@dataclass(frozen=True)
class AttentionPlan:
    """Launch shape of one attention call, fixed per (rows, tokens, context bound) so graphs can hold it."""

    block_t: int
    block_m: int
    splits: int
    block_n: int = 64
    num_warps: int = 4


def plan_attention(
    rows: int, tokens: int, max_context: int, num_heads: int, num_kv_heads: int, sm_count: int
) -> AttentionPlan:
    """Query tiles of >= 16 rows (tensor-core dots) and context splits while the GPU has SMs to spare.

    A decode row's latency is its longest split, so while (row, KV head) programs are few (at most a quarter of the
    SMs) short contexts split into ~64 keys, longer ones ~256; with more programs only past 512 keys. Past 512 keys,
    wider key blocks while there is at most one program per SM. Rows of several query blocks (verify, prefill)
    split into at most one wave (2 programs per SM), at least 512 keys each. Tuned on an H200 inside the Qwen3
    forwards (docs/measurements/2026-11-27-ops-notes.md); the SM count is this GPU's."""
    group = num_heads // num_kv_heads
    one_block = tokens * group <= 16  # a row's queries fill one tile
    block_t = max(1, 16 // group) if one_block else min(triton.next_power_of_2(tokens), max(1, 64 // group))
    block_m = max(16, triton.next_power_of_2(block_t * group))
    programs = rows * num_kv_heads * triton.cdiv(tokens, block_t)
    if not one_block:
        splits = min(_power_of_two_at_most(2 * sm_count // programs), _power_of_two_at_most(max_context // 512))
        return AttentionPlan(block_t, block_m, min(16, splits), block_n=64, num_warps=4)
    by_occupancy = triton.next_power_of_2(max(1, triton.cdiv(2 * sm_count, programs)))
    few = rows * num_kv_heads <= sm_count // 4  # few programs: latency decides
    if few:
        by_context = triton.next_power_of_2(triton.cdiv(max_context, 64 if max_context <= 512 else 256))
    else:
        by_context = 1 if max_context <= 512 else triton.next_power_of_2(triton.cdiv(max_context, 256))
    splits = min(16, by_occupancy, by_context)
    if max_context <= 512:
        block_n, num_warps = (64 if few else 128), 4
    elif programs * splits <= sm_count:  # at most one program per SM: each one wider
        block_n, num_warps = 128, 4
    else:
        block_n, num_warps = 64, 2
    return AttentionPlan(block_t, block_m, splits, block_n=block_n, num_warps=num_warps)


def _power_of_two_at_most(n: int) -> int:
    """The largest power of two <= n (1 for n < 1)."""
    return 1 << (max(n, 1).bit_length() - 1)


def paged_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
    start: torch.Tensor,
    num_new: torch.Tensor,
    plan: AttentionPlan,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [R, T, H, D] over keys/values [slots, Hkv, D]; row r's token t sits at column start[r] + t of
    table[rows[r]] and sees the columns <= its own (or mask[r, t]). Returns [R, T, H, D]."""
    r, t, h, d = q.shape
    hkv = keys.shape[1]
    group = h // hkv
    out = torch.empty_like(q)
    block_d = max(16, triton.next_power_of_2(d))
    if plan.splits > 1:
        part_acc = torch.empty(plan.splits, r, t, h, d, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(plan.splits, r, t, h, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out
    mask_arg = mask if mask is not None else rows
    grid = (r * triton.cdiv(t, plan.block_t), hkv, plan.splits)
    _attention_kernel[grid](
        q,
        keys,
        values,
        table,
        rows,
        start,
        num_new,
        mask_arg,
        out,
        part_acc,
        part_ml,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        keys.stride(0),
        keys.stride(1),
        table.stride(0),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        mask.stride(0) if mask is not None else 0,
        mask.stride(1) if mask is not None else 0,
        r,
        t,
        math.log2(math.e) / math.sqrt(d),
        GROUP=group,
        BLOCK_T=plan.block_t,
        BLOCK_M=plan.block_m,
        BLOCK_N=plan.block_n if block_d <= 128 else 32,
        BLOCK_D=block_d,
        HEAD_DIM=d,
        NUM_HEADS=h,
        SPLITS=plan.splits,
        HAS_MASK=mask is not None,
        IEEE=q.dtype == torch.float32,
        num_warps=plan.num_warps,
        **pdl_launch(q.device),
    )
    if plan.splits > 1:
        _combine_kernel[(r * t, h)](
            part_acc,
            part_ml,
            out,
            out.stride(0),
            out.stride(1),
            out.stride(2),
            r,
            t,
            NUM_HEADS=h,
            HEAD_DIM=d,
            BLOCK_D=block_d,
            SPLITS=plan.splits,
            **pdl_launch(q.device),
        )
    return out
