"""Paged attention in Triton over page-size-1 block tables (decode, verify and prefill chunks alike).

A program takes one row, one KV head, a block of query tokens and one split of the context; its query tile holds
the G query heads sharing the KV head (GQA), so each key/value block is read once for all of them. Causality is by
column, or an explicit bool mask [R, T, L] (the EAGLE3 training-time test; draft trees later). Long rows split
along the context (flash-decoding) with a combining kernel. Softmax in fp32; fp32 models use IEEE dots so they
match the reference exactly.

Rows that come in runs sharing their first KV columns (an SMC request's particles fork from one prompt) can read
those columns once per run (cascade attention, as flashinfer's shared-prefix kernels do): `shared_columns` finds
each run's common prefix on the device, `_shared_prefix_kernel` attends every query of the run over it in one
tile, and the per-row kernel starts its online softmax from that state and reads only the row's own columns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from hsmc.ops.pdl import pdl_launch


@triton.jit
def _block_scores(q, k_head_ptr, row_table_ptr, cols, c_valid, stride_kslot, d, d_valid, IEEE: tl.constexpr):
    """q's raw scores against one block of a row's key columns (`k_head_ptr`: the keys of q's KV head), with the
    block's K/V offsets and mask."""
    slots = tl.load(row_table_ptr + cols, mask=c_valid, other=0)
    kv_offsets = slots[:, None] * stride_kslot + d[None, :]
    kv_mask = c_valid[:, None] & d_valid[None, :]
    k = tl.load(k_head_ptr + kv_offsets, mask=kv_mask, other=0.0)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    return s, kv_offsets, kv_mask


@triton.jit
def _online_softmax_step(s, v_head_ptr, kv_offsets, kv_mask, m_i, l_i, acc, IEEE: tl.constexpr):
    """One key block (scores `s` scaled to log2 and masked to -inf) into each query's running max, sum of weights and
    weighted values."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_head_ptr + kv_offsets, mask=kv_mask, other=0.0)
    if IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


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
    shared_ptr,
    shared_out_ptr,
    shared_lse_ptr,
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
    SHARED_ROWS: tl.constexpr,
    SHARED_SPLITS: tl.constexpr,
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
    first = 0  # columns before it were attended by the shared-prefix kernel
    if SHARED_ROWS > 0:
        first = tl.load(shared_ptr + (r // SHARED_ROWS) * 2)
    chunk = tl.cdiv(tl.cdiv(tl.maximum(kv_end - first, 0), SPLITS), BLOCK_N) * BLOCK_N
    lo = first + split * chunk
    hi = tl.minimum(lo + chunk, kv_end)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if SHARED_ROWS > 0:
        if split == 0:  # start from the shared prefix's softmax state: its normalized output and log2-sum-exp
            for s in tl.static_range(SHARED_SPLITS):
                part = ((s * num_rows + r) * T + t) * NUM_HEADS + head
                lse = tl.load(shared_lse_ptr + part, mask=m_valid, other=float("-inf"))
                o = tl.load(
                    shared_out_ptr + part[:, None] * HEAD_DIM + d[None, :],
                    mask=m_valid[:, None] & d_valid[None, :],
                    other=0.0,
                ).to(tl.float32)
                m_new = tl.maximum(m_i, lse)
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m_i - m_safe)
                w = tl.exp2(lse - m_safe)
                l_i = l_i * alpha + w
                acc = acc * alpha[:, None] + o * w[:, None]
                m_i = m_new
    row_table_ptr = table_ptr + row * stride_table
    k_head_ptr = k_ptr + kv_head * stride_khead
    v_head_ptr = v_ptr + kv_head * stride_khead
    for k0 in range(lo, hi, BLOCK_N):
        cols = k0 + tl.arange(0, BLOCK_N)
        c_valid = cols < hi
        s, kv_offsets, kv_mask = _block_scores(
            q, k_head_ptr, row_table_ptr, cols, c_valid, stride_kslot, d, d_valid, IEEE
        )
        if HAS_MASK:
            seen = tl.load(
                mask_ptr + r * stride_mr + t[:, None] * stride_mt + cols[None, :],
                mask=m_valid[:, None] & c_valid[None, :],
                other=0,
            )
            allowed = c_valid[None, :] & (seen != 0)
        else:
            allowed = c_valid[None, :] & (cols[None, :] <= q_col[:, None])
        s = tl.where(allowed, s * scale_log2, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, v_head_ptr, kv_offsets, kv_mask, m_i, l_i, acc, IEEE)

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
def _shared_columns_kernel(
    table_ptr,
    rows_ptr,
    start_ptr,
    num_new_ptr,
    shared_ptr,
    stride_table,
    num_rows,
    RUN: tl.constexpr,
    BLOCK_RUN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Per run of RUN rows: how many leading columns every row bringing tokens has, with the same slots (the run's
    shared prefix), and the table row of the first such row (whose slots the shared-prefix pass reads). Rows without
    tokens (padding) do not count; a run without such rows shares nothing."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    run = tl.program_id(0)
    i = run * RUN + tl.arange(0, BLOCK_RUN)
    in_run = (tl.arange(0, BLOCK_RUN) < RUN) & (i < num_rows)
    row = tl.load(rows_ptr + i, mask=in_run, other=0)
    start = tl.load(start_ptr + i, mask=in_run, other=0)
    active = in_run & (tl.load(num_new_ptr + i, mask=in_run, other=0) > 0)
    bound = tl.min(tl.where(active, start, 1 << 40), 0)
    bound = tl.where(bound == 1 << 40, 0, bound)  # every query of the run sees columns < bound
    shared = bound
    c0 = bound * 0
    while c0 < shared:  # up to the first column where the rows differ, not over the whole context
        cols = c0 + tl.arange(0, BLOCK_N)
        slots = tl.load(
            table_ptr + row[:, None] * stride_table + cols[None, :],
            mask=active[:, None] & (cols < shared)[None, :],
            other=0,
        )
        highest = tl.max(tl.where(active[:, None], slots, -1), 0)
        lowest = tl.min(tl.where(active[:, None], slots, 1 << 40), 0)
        differ = (highest != lowest) & (cols < shared)
        shared = tl.minimum(shared, tl.min(tl.where(differ, cols, shared), 0))
        c0 += BLOCK_N
    first_active = tl.min(tl.where(active, i, num_rows), 0)
    tl.store(shared_ptr + run * 2, shared)
    tl.store(shared_ptr + run * 2 + 1, tl.load(rows_ptr + first_active, mask=first_active < num_rows, other=0))


@triton.jit
def _shared_prefix_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    table_ptr,
    shared_ptr,
    out_ptr,
    lse_ptr,
    stride_qr,
    stride_qt,
    stride_qh,
    stride_kslot,
    stride_khead,
    stride_table,
    num_rows,
    T,
    scale_log2,
    RUN: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    SPLITS: tl.constexpr,
    IEEE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Every query of a run (RUN rows x T tokens x the GROUP heads of one KV head, BLOCK_P (row, token) pairs a
    program) over one split of the run's shared columns, which every query sees: each key block is read once for
    the run. Writes the normalized output (q's dtype) and the log2-sum-exp per query, [SPLITS, R, T, H]."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_pb = tl.cdiv(RUN * T, BLOCK_P)
    run = pid // num_pb
    pb = pid % num_pb
    shared = tl.load(shared_ptr + run * 2)
    row = tl.load(shared_ptr + run * 2 + 1)  # the shared columns' slots are the same in every row bringing tokens

    m = tl.arange(0, BLOCK_M)
    pair = pb * BLOCK_P + m // GROUP
    r = run * RUN + pair // T
    t = pair % T
    head = kv_head * GROUP + m % GROUP
    m_valid = (m < BLOCK_P * GROUP) & (pair < RUN * T) & (r < num_rows)
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM
    q = tl.load(
        q_ptr + r[:, None] * stride_qr + t[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=m_valid[:, None] & d_valid[None, :],
        other=0.0,
    )

    chunk = tl.cdiv(tl.cdiv(shared, SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, shared)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    row_table_ptr = table_ptr + row * stride_table
    k_head_ptr = k_ptr + kv_head * stride_khead
    v_head_ptr = v_ptr + kv_head * stride_khead
    for k0 in range(lo, hi, BLOCK_N):
        cols = k0 + tl.arange(0, BLOCK_N)
        c_valid = cols < hi
        s, kv_offsets, kv_mask = _block_scores(
            q, k_head_ptr, row_table_ptr, cols, c_valid, stride_kslot, d, d_valid, IEEE
        )
        s = tl.where(c_valid[None, :], s * scale_log2, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, v_head_ptr, kv_offsets, kv_mask, m_i, l_i, acc, IEEE)

    seen = l_i > 0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    part = ((split * num_rows + r) * T + t) * NUM_HEADS + head
    tl.store(
        out_ptr + part[:, None] * HEAD_DIM + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_valid[:, None] & d_valid[None, :],
    )
    tl.store(lse_ptr + part, lse, mask=m_valid)


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


MAX_SHARED_TOKENS = 32  # tokens per row up to which runs of rows read a shared prefix once (decode and verify)
# Where reading a run's prefix once paid on an H200 (docs/measurements/2026-11-30-h200-shared-prefix-attention.txt,
# 2026-11-30-h200-attention-many-programs.txt): 16 runs of 8 rows over 2,064 keys 1.55-1.82x; over 272 keys
# 1-token rows 1.19x, 9-token rows 0.98x; one run 0.45-0.66x (three launches where the rows' own plan splits over
# the whole GPU). Fewer runs were not measured faster.
MIN_SHARED_RUNS = 16
MIN_SHARED_CONTEXT = 513  # keys: above the shortest graph bucket (512), for rows of several tokens
MIN_SHARED_CONTEXT_ONE_TOKEN = 257  # keys, for decode rows (SMC proposal steps): the 512 bucket qualifies
MANY_PROGRAMS = 4  # (row, KV head) programs per SM from which attention is bound by throughput, not latency


@dataclass(frozen=True)
class SharedPrefixPlan:
    """Launch shape of the shared-prefix pass: runs of `run` rows, `block_p` (row, token) pairs a program."""

    run: int
    block_p: int
    block_m: int
    splits: int
    block_n: int = 64
    num_warps: int = 4


@dataclass(frozen=True)
class AttentionPlan:
    """Launch shape of one attention call, fixed per (rows, tokens, context bound) so graphs can hold it."""

    block_t: int
    block_m: int
    splits: int
    block_n: int = 64
    num_warps: int = 4
    shared: SharedPrefixPlan | None = None  # runs of rows read their common prefix once first


def shares_prefix(rows: int, tokens: int, max_context: int, run: int, masked: bool) -> bool:
    """Whether a forward's attention reads shared prefixes once per run of `run` rows: decode and verify steps
    (prefill chunks are one row a request) of many runs over long contexts, where that was measured faster, causal
    (a tree mask is per row)."""
    many = run > 1 and triton.cdiv(rows, run) >= MIN_SHARED_RUNS
    long_enough = max_context >= (MIN_SHARED_CONTEXT_ONE_TOKEN if tokens == 1 else MIN_SHARED_CONTEXT)
    return many and long_enough and tokens <= MAX_SHARED_TOKENS and not masked


def plan_shared_prefix(
    rows: int, tokens: int, max_context: int, num_heads: int, num_kv_heads: int, sm_count: int, run: int
) -> SharedPrefixPlan:
    """A run's (row, token) pairs in tiles of up to 64 query heads, and splits of the prefix (>= 128 keys each)
    while the GPU has SMs to spare. Tiles of <= 32 queries (decode rows) read 128-key blocks: each block's gather
    is a latency the small tile cannot hide; larger tiles (verify rows) 32-key blocks, as the per-row pass's
    throughput plan (1.07-1.22x and 1.11-1.15x over 64-key blocks on an H200, `sweep_kernels.py --parts
    shared-prefix`)."""
    group = num_heads // num_kv_heads
    pairs = run * tokens
    block_p = min(triton.next_power_of_2(pairs), max(1, 64 // group))
    block_m = max(16, triton.next_power_of_2(block_p * group))
    programs = triton.cdiv(rows, run) * triton.cdiv(pairs, block_p) * num_kv_heads
    splits = min(16, _power_of_two_at_most(2 * sm_count // programs), _power_of_two_at_most(max_context // 128))
    return SharedPrefixPlan(run, block_p, block_m, splits, block_n=128 if block_m <= 32 else 32)


def plan_attention(
    rows: int, tokens: int, max_context: int, num_heads: int, num_kv_heads: int, sm_count: int, run: int = 1
) -> AttentionPlan:
    """Query tiles of >= 16 rows (tensor-core dots) and context splits while the GPU has SMs to spare.

    A decode row's latency is its longest split, so while (row, KV head) programs are few (at most a quarter of the
    SMs) short contexts split into ~64 keys, longer ones ~256; with more programs only past 512 keys. Past 512 keys,
    wider key blocks while there is at most one program per SM. Rows of several query blocks (verify, prefill)
    split into at most one wave (2 programs per SM), at least 512 keys each. With MANY_PROGRAMS per SM or more
    (16 requests' particles), throughput decides: decode rows over <= 512 keys take 64-key blocks of 2 warps, and a
    verify row's queries (<= 128) one tile over 32-key blocks (1.07-1.15x, docs/measurements/
    2026-11-30-h200-attention-many-programs.txt). Tuned on an H200 inside the Qwen3 forwards
    (docs/measurements/2026-11-27-ops-notes.md); the SM count is this GPU's. With `run` > 1 (rows come in
    runs that may share a prefix, `shares_prefix`) the plan holds the shared-prefix pass too."""
    plan = _plan_rows(rows, tokens, max_context, num_heads, num_kv_heads, sm_count)
    if run > 1:
        shared = plan_shared_prefix(rows, tokens, max_context, num_heads, num_kv_heads, sm_count, run)
        return replace(plan, shared=shared)
    return plan


def _plan_rows(
    rows: int, tokens: int, max_context: int, num_heads: int, num_kv_heads: int, sm_count: int
) -> AttentionPlan:
    """The per-row pass (`plan_attention`)."""
    group = num_heads // num_kv_heads
    one_block = tokens * group <= 16  # a row's queries fill one tile
    block_t = max(1, 16 // group) if one_block else min(triton.next_power_of_2(tokens), max(1, 64 // group))
    block_m = max(16, triton.next_power_of_2(block_t * group))
    programs = rows * num_kv_heads * triton.cdiv(tokens, block_t)
    many = programs >= MANY_PROGRAMS * sm_count
    if not one_block and many and tokens * group <= 128:  # verify steps of many rows: a row's queries in one tile
        block_t = min(triton.next_power_of_2(tokens), 128 // group)
        return AttentionPlan(block_t, max(16, triton.next_power_of_2(block_t * group)), 1, block_n=32, num_warps=4)
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
    if max_context <= 512 and many:
        block_n, num_warps = 64, 2
    elif max_context <= 512:
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
    shared: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [R, T, H, D] over keys/values [slots, Hkv, D]; row r's token t sits at column start[r] + t of
    table[rows[r]] and sees the columns <= its own (or mask[r, t]). `shared`: `shared_columns` of the batch for
    the plan's runs (required with `plan.shared`). Returns [R, T, H, D]."""
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
    if plan.shared is not None:
        if shared is None or mask is not None:
            raise ValueError("a shared-prefix plan needs the batch's shared columns and causal attention")
        shared_out, shared_lse = _shared_prefix(q, keys, values, table, shared, plan.shared)
    else:
        shared = shared_out = shared_lse = rows  # unread
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
        shared,
        shared_out,
        shared_lse,
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
        SHARED_ROWS=plan.shared.run if plan.shared is not None else 0,
        SHARED_SPLITS=plan.shared.splits if plan.shared is not None else 1,
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


def shared_columns(
    table: torch.Tensor, rows: torch.Tensor, start: torch.Tensor, num_new: torch.Tensor, run: int
) -> torch.Tensor:
    """int64 [ceil(R / run), 2]: per run of `run` consecutive rows, the leading columns that all its rows bringing
    tokens hold in the same slots and see (before every such row's first new column), and the table row of the first
    of them. Computed once per forward; every layer's attention reads it."""
    runs = triton.cdiv(rows.shape[0], run)
    shared = torch.empty(runs, 2, dtype=torch.int64, device=rows.device)
    _shared_columns_kernel[(runs,)](
        table,
        rows,
        start,
        num_new,
        shared,
        table.stride(0),
        rows.shape[0],
        RUN=run,
        BLOCK_RUN=triton.next_power_of_2(run),
        BLOCK_N=128,
        **pdl_launch(rows.device),
    )
    return shared


def _shared_prefix(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    table: torch.Tensor,
    shared: torch.Tensor,
    plan: SharedPrefixPlan,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared-prefix pass: every query's normalized output [splits, R, T, H, D] and log2-sum-exp over its run's
    shared columns."""
    r, t, h, d = q.shape
    out = torch.empty(plan.splits, r, t, h, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(plan.splits, r, t, h, dtype=torch.float32, device=q.device)
    block_d = max(16, triton.next_power_of_2(d))
    grid = (shared.shape[0] * triton.cdiv(plan.run * t, plan.block_p), keys.shape[1], plan.splits)
    _shared_prefix_kernel[grid](
        q,
        keys,
        values,
        table,
        shared,
        out,
        lse,
        q.stride(0),
        q.stride(1),
        q.stride(2),
        keys.stride(0),
        keys.stride(1),
        table.stride(0),
        r,
        t,
        math.log2(math.e) / math.sqrt(d),
        RUN=plan.run,
        GROUP=h // keys.shape[1],
        BLOCK_P=plan.block_p,
        BLOCK_M=plan.block_m,
        BLOCK_N=plan.block_n if block_d <= 128 else 32,
        BLOCK_D=block_d,
        HEAD_DIM=d,
        NUM_HEADS=h,
        SPLITS=plan.splits,
        IEEE=q.dtype == torch.float32,
        num_warps=plan.num_warps,
        **pdl_launch(q.device),
    )
    return out, lse
