"""A forward's KV slots allocated and appended to the rows' block tables in two launches, and rows rolled back in
one (CUDA): `TritonBackend.append_slots` / `rollback_slots`, with `TorchBackend`'s torch ops as the reference.

The reference takes about 36 small kernels per append (a pool-wide cumulative sum of free slots, searches, indexed
copies, bounds checks) and ~20 per rollback, each on the serial chain of a graphed cycle. Here one kernel counts
each chunk's free slots, and one program walks only the chunks holding the ranks it needs, hands out the slots in
the reference's order (lowest-numbered free slots, row by row), bumps their refcounts and writes the tables,
lengths, slots and new columns; a rollback is one program releasing the dropped slots with atomics. What the
reference asserts comes back as two flags for `torch._assert_async`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hsmc.ops.token_rows import row_tiles

MAX_CHUNKS = 1024  # chunks of the pool the appending program looks at in one vector


def chunk_size(num_slots: int) -> int:
    """Slots per counted chunk: 1024, or more for pools of over a million slots."""
    return max(1024, triton.next_power_of_2(triton.cdiv(num_slots, MAX_CHUNKS)))


@triton.jit
def _count_free_kernel(refcount_ptr, free_ptr, num_slots, CHUNK: tl.constexpr):
    c = tl.program_id(0)
    idx = c * CHUNK + tl.arange(0, CHUNK)
    ref = tl.load(refcount_ptr + idx, mask=idx < num_slots, other=1)
    tl.store(free_ptr + c, tl.sum((ref == 0).to(tl.int64), 0))


@triton.jit
def _append_kernel(
    refcount_ptr,
    free_ptr,
    found_ptr,
    table_ptr,
    length_ptr,
    rows_ptr,
    counts_ptr,
    slots_ptr,
    start_ptr,
    columns_ptr,
    ok_ptr,
    num_slots,
    num_chunks,
    R,
    width,
    stride_table,
    max_row_tokens,
    CHUNK: tl.constexpr,
    BLOCK_CHUNKS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    r = tl.arange(0, BLOCK_R)
    r_ok = r < R
    counts = tl.minimum(tl.load(counts_ptr + r, mask=r_ok, other=0), width)  # <= width by contract; `found` is R·width
    total = tl.sum(counts, 0)
    offsets = tl.cumsum(counts, 0) - counts  # rank (0-based) of each row's first slot

    # the free slots of rank 1..total: from the first chunk with a free slot to the one holding rank `total`
    ch = tl.arange(0, BLOCK_CHUNKS)
    free = tl.load(free_ptr + ch, mask=ch < num_chunks, other=0)
    ranked = tl.cumsum(free, 0)
    available = tl.sum(free, 0)
    first = tl.min(tl.where(free > 0, ch, BLOCK_CHUNKS), 0)
    last = tl.min(tl.where((ranked >= total) & (ch < num_chunks), ch, num_chunks - 1), 0)
    end = tl.where(total > 0, last + 1, first)
    base = tl.zeros([], dtype=tl.int64)
    for c in range(first, end):
        idx = c * CHUNK + tl.arange(0, CHUNK)
        is_free = tl.load(refcount_ptr + idx, mask=idx < num_slots, other=1) == 0
        rank = base + tl.cumsum(is_free.to(tl.int64), 0)
        take = is_free & (rank <= total)
        tl.store(found_ptr + rank - 1, idx.to(tl.int64), mask=take)
        tl.store(refcount_ptr + idx, tl.full([CHUNK], 1, tl.int32), mask=take)
        base += tl.sum(is_free.to(tl.int64), 0)
    tl.debug_barrier()  # `found` is written by all of this program's threads, read below by others

    rows = tl.load(rows_ptr + r, mask=r_ok, other=0)
    start = tl.load(length_ptr + rows, mask=r_ok, other=0)
    fits = tl.min(tl.where(r_ok, start + counts <= max_row_tokens, True).to(tl.int32), 0)
    tl.store(ok_ptr, (available >= total).to(tl.int32))
    tl.store(ok_ptr + 1, fits)
    tl.store(start_ptr + r, start, mask=r_ok)
    last_col = tl.maximum(counts - 1, 0)  # padding repeats a row's last new column
    got_below = tl.minimum(total, available)
    for w0 in range(0, width, BLOCK_W):
        j = w0 + tl.arange(0, BLOCK_W)
        in_out = r_ok[:, None] & (j < width)[None, :]
        rank = offsets[:, None] + j[None, :]
        got = in_out & (j[None, :] < counts[:, None]) & (rank < got_below)
        slot = tl.load(found_ptr + rank, mask=got, other=num_slots)
        tl.store(slots_ptr + r[:, None] * width + j[None, :], tl.where(got, slot, num_slots), mask=in_out)
        padded = start[:, None] + tl.minimum(j[None, :], last_col[:, None])
        tl.store(columns_ptr + r[:, None] * width + j[None, :], padded, mask=in_out)
        col = start[:, None] + j[None, :]
        tl.store(table_ptr + rows[:, None] * stride_table + col, slot, mask=got & (col < max_row_tokens))
    tl.store(length_ptr + rows, start + counts, mask=r_ok)


def append_slots(
    refcount: torch.Tensor,
    table: torch.Tensor,
    length: torch.Tensor,
    rows: torch.Tensor,
    counts: torch.Tensor,
    width: int,
    max_row_tokens: int,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`BlockTables.append` on the device: counts[i] <= width new slots (refcount 0 -> 1, the lowest-numbered free
    ones) at the end of row rows[i]'s table; returns the slots [R, width] (the trash slot past counts[i]), each
    row's length before (start [R]), the new tokens' columns [R, width] (`padded_columns`), and int32 flags
    [enough free slots, every row fits its table]. `chunk` overrides the counted chunk's size."""
    num_slots = refcount.shape[0] - 1
    chunk = chunk or chunk_size(num_slots)
    num_chunks = triton.cdiv(num_slots, chunk)
    r = rows.shape[0]
    free = torch.empty(num_chunks, dtype=torch.int64, device=refcount.device)
    found = torch.empty(max(r * width, 1), dtype=torch.int64, device=refcount.device)
    slots, columns = torch.empty(2, r, max(width, 1), dtype=torch.int64, device=refcount.device)[:, :, :width]
    start = torch.empty(r, dtype=torch.int64, device=refcount.device)  # (width 0 still gets real pointers)
    ok = torch.empty(2, dtype=torch.int32, device=refcount.device)
    if r == 0:
        return slots, start, columns, ok.fill_(1)
    _count_free_kernel[(num_chunks,)](refcount, free, num_slots, CHUNK=chunk)
    block_r, block_w = row_tiles(r, width)
    _append_kernel[(1,)](
        refcount, free, found, table, length, rows, counts, slots, start, columns, ok, num_slots, num_chunks, r, width,
        table.stride(0), max_row_tokens, CHUNK=chunk, BLOCK_CHUNKS=triton.next_power_of_2(num_chunks),
        BLOCK_R=block_r, BLOCK_W=block_w, num_warps=4,
    )  # fmt: skip
    return slots, start, columns, ok


@triton.jit
def _rollback_kernel(
    refcount_ptr,
    table_ptr,
    length_ptr,
    rows_ptr,
    values_ptr,
    ok_ptr,
    R,
    max_drop,
    stride_table,
    TO_LENGTH: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    r = tl.arange(0, BLOCK_R)
    r_ok = r < R
    rows = tl.load(rows_ptr + r, mask=r_ok, other=0)
    end = tl.load(length_ptr + rows, mask=r_ok, other=0)
    value = tl.load(values_ptr + r, mask=r_ok, other=0)
    count = tl.maximum(end - value, 0) if TO_LENGTH else value  # a new length, or the tokens to drop
    valid = (count >= 0) & (count <= end) & (count <= max_drop)
    counts_ok = tl.min(tl.where(r_ok, valid, True).to(tl.int32), 0)
    released_ok = tl.full([], 1, tl.int32)
    for d0 in range(0, max_drop, BLOCK_D):
        back = d0 + 1 + tl.arange(0, BLOCK_D)  # 1 = the row's last token
        dropped = (r_ok & valid)[:, None] & (back[None, :] <= count[:, None])
        slot = tl.load(table_ptr + rows[:, None] * stride_table + end[:, None] - back[None, :], mask=dropped, other=0)
        before = tl.atomic_add(refcount_ptr + slot, tl.full([BLOCK_R, BLOCK_D], -1, tl.int32), mask=dropped)
        released_ok = tl.minimum(released_ok, tl.min(tl.where(dropped, before >= 1, True).to(tl.int32)))
    tl.store(length_ptr + rows, end - tl.where(valid, count, 0), mask=r_ok)
    tl.store(ok_ptr, counts_ok)
    tl.store(ok_ptr + 1, released_ok)


def rollback_slots(
    refcount: torch.Tensor,
    table: torch.Tensor,
    length: torch.Tensor,
    rows: torch.Tensor,
    values: torch.Tensor,
    max_drop: int,
    to_length: bool,
) -> torch.Tensor:
    """`BlockTables.rollback` (values: tokens to drop per row) or `truncate` (`to_length`: each row's new length, rows
    already shorter keep theirs) on the device, rows unique; returns int32 flags [every count in 0..min(length,
    max_drop), no slot released below zero references]."""
    ok = torch.ones(2, dtype=torch.int32, device=refcount.device)
    if rows.shape[0] == 0:
        return ok
    block_r, block_d = row_tiles(rows.shape[0], max_drop)
    _rollback_kernel[(1,)](
        refcount, table, length, rows, values, ok, rows.shape[0], max_drop, table.stride(0), TO_LENGTH=to_length,
        BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4,
    )  # fmt: skip
    return ok
