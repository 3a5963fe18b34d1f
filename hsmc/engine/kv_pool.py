"""Token slots, their refcounts, and per-row block tables.

Every model of a stack stores the KV of a token at the same *slot id* in its own cache
(`KVCache`), so one set of refcounts serves all models' pools. A row (a request, or one SMC
particle) owns a block table: column -> slot id, page size 1. Forking a row (fan-out of a
prompt to N particles, resampling) copies slot ids and bumps refcounts: no KV byte moves.

All state lives in tensors on the engine's device and every operation is a fixed sequence of
tensor ops whose shapes depend only on host-known sizes: no Python loop over rows, no host read,
so the same code runs inside a captured CUDA graph. Variable amounts (how many tokens a row gains
or drops) are per-row counts on the device, applied through masks and weighted refcount updates
(`index_add_` of 0 or ±1) instead of boolean compaction. A slot is free exactly when its refcount
is 0; allocation takes the lowest-numbered free slots through a cumulative sum, so there is no
free list to keep consistent. Slot id `num_slots` is the trash slot: padding writes and masked-out
updates go there. Misuse (out of slots, table overflow, double free) is caught by
`torch._assert_async`, which raises at once on the CPU and without a sync on the GPU. The append before every
forward and the rollbacks run through the stack's backend: torch ops (the reference, `TorchBackend`) or two
Triton kernels and one (`hsmc.ops.kv_slots`).
"""

from __future__ import annotations

import torch

from hsmc.ops.backend import OUT_OF_SLOTS, OVER_RELEASED, Backend, TorchBackend


class SlotAllocator:
    """Refcounted token slots shared by every model's KV cache (plus the trash slot `num_slots`)."""

    def __init__(self, num_slots: int, device: torch.device | str = "cpu") -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.num_slots = num_slots
        self.refcount = torch.zeros(num_slots + 1, dtype=torch.int32, device=device)

    @property
    def device(self) -> torch.device:
        return self.refcount.device

    @property
    def trash_slot(self) -> int:
        return self.num_slots

    def num_free(self) -> int:
        """Host-side count of free slots (reads the device: for admission control and tests, not the hot path)."""
        return int((self.refcount[: self.num_slots] == 0).sum())

    def alloc(self, counts: torch.Tensor, width: int) -> torch.Tensor:
        """Take counts[i] <= width free slots for each entry i (refcount 0 -> 1); int64 [len(counts), width],
        entries past counts[i] are the trash slot."""
        free_rank = torch.cumsum((self.refcount[: self.num_slots] == 0).to(torch.int64), 0)
        offsets = torch.cumsum(counts, 0) - counts
        cols = torch.arange(width, device=self.device)
        wanted = offsets[:, None] + cols[None, :] + 1
        valid = cols[None, :] < counts[:, None]
        slots = torch.searchsorted(free_rank, wanted)
        torch._assert_async((slots < self.num_slots).logical_or(~valid).all(), OUT_OF_SLOTS)
        slots = torch.where(valid, slots.clamp_max(self.num_slots - 1), self.trash_slot)
        self.refcount.index_add_(0, slots.reshape(-1), valid.reshape(-1).to(torch.int32))
        return slots

    def add_refs(self, slots: torch.Tensor, weights: torch.Tensor) -> None:
        """refcount[slots[i]] += weights[i] (weights 0 leave a slot alone; duplicates add up)."""
        self.refcount.index_add_(0, slots.reshape(-1), weights.reshape(-1).to(torch.int32))
        torch._assert_async((self.refcount[: self.num_slots] >= 0).all(), OVER_RELEASED)

    def free(self, slots: torch.Tensor) -> None:
        """Free slots the caller owns alone (refcount exactly 1)."""
        flat = slots.reshape(-1)
        torch._assert_async((self.refcount[flat] == 1).all(), "free() on a KV slot that is shared or already free")
        self.refcount[flat] = 0


class BlockTables:
    """Per-row column -> slot tables over one `SlotAllocator`.

    `table[row, :length[row]]` are the row's slots; entries past `length` are stale and never read
    (attention stops at each row's length), so a rollback only lowers `length` after releasing.
    Row `max_rows` is a scratch row that is always empty (the padding rows of a graph bucket point
    at it) and column `max_row_tokens` a trash column for masked-out writes.
    """

    def __init__(
        self, allocator: SlotAllocator, max_rows: int, max_row_tokens: int, backend: Backend | None = None
    ) -> None:
        self.allocator = allocator
        self.backend = backend or TorchBackend()  # appends and rollbacks: the stack's device steps
        self.max_rows = max_rows
        self.max_row_tokens = max_row_tokens
        device = allocator.device
        self.table = torch.full(
            (max_rows + 1, max_row_tokens + 1), allocator.trash_slot, dtype=torch.int64, device=device
        )
        self.length = torch.zeros(max_rows + 1, dtype=torch.int64, device=device)
        self._cols = torch.arange(max_row_tokens, device=device)

    @property
    def scratch_row(self) -> int:
        return self.max_rows

    def _owned(self, rows: torch.Tensor, max_len: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' tables [R, W] and the 0/1 weight of each entry (1 where the row owns it); W is the
        caller's host-known bound on the rows' lengths (the whole table without one)."""
        width = self.max_row_tokens if max_len is None else max(1, min(max_len, self.max_row_tokens))
        owned = self._cols[None, :width] < self.length[rows][:, None]
        torch._assert_async((self.length[rows] <= width).all(), "release/copy bound below a row's length")
        return self.table[rows, :width], owned

    def append(
        self, rows: torch.Tensor, counts: torch.Tensor, width: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Allocate counts[i] <= width new slots at the end of row rows[i]; returns them [R, width] (trash past
        counts[i]), each row's length before (start [R]) and the new tokens' columns [R, width] (padding repeats
        a row's last: `padded_columns`). Two Triton kernels with the Triton backend (`hsmc.ops.kv_slots`)."""
        return self.backend.append_slots(self, rows, counts, width)

    def rollback(self, rows: torch.Tensor, counts: torch.Tensor, max_count: int) -> None:
        """Drop the last `counts[i]` tokens of `rows[i]` (0 <= counts <= max_count, a host-known bound; rows
        unique)."""
        self.backend.rollback_slots(self, rows, counts, max_count, to_length=False)

    def truncate(self, rows: torch.Tensor, new_length: torch.Tensor, max_drop: int) -> None:
        """Cut each row back to at most new_length[i] tokens (rows already shorter keep theirs)."""
        self.backend.rollback_slots(self, rows, new_length, max_drop, to_length=True)

    def permute(self, rows: torch.Tensor, start: torch.Tensor, order: torch.Tensor) -> None:
        """Column start[i] + j of row rows[i] takes the slot of column start[i] + order[i, j] (order [R, W] a
        permutation of 0..W-1 over columns the row holds): a draft tree's accepted path moved to the front of its
        block, no KV byte moved and no refcount changed (a truncate then frees the rest)."""
        columns = torch.arange(order.shape[1], device=order.device)
        src = (start[:, None] + order).clamp_max(self.max_row_tokens)
        dst = (start[:, None] + columns).clamp_max(self.max_row_tokens)
        self.table[rows[:, None], dst] = self.table[rows[:, None], src]

    def release(self, rows: torch.Tensor, max_len: int | None = None) -> None:
        """Give up every slot of `rows` (each at most `max_len` long, when given); they become empty rows."""
        table, owned = self._owned(rows, max_len)
        self.allocator.add_refs(table, -owned.to(torch.int32))
        self.length.index_fill_(0, rows, 0)  # (indexed assignment of a Python scalar would sync)

    def copy_block_table(self, src_rows: torch.Tensor, dst_rows: torch.Tensor, max_len: int | None = None) -> None:
        """dst[i] becomes a copy of src[i], sharing its slots (rows at most `max_len` long, when given). Safe
        when src and dst overlap (a resampling permutation): the sources are read and referenced first."""
        table, owned = self._owned(src_rows, max_len)
        length = self.length[src_rows]
        self.allocator.add_refs(table, owned.to(torch.int32))
        self.release(dst_rows, max_len)
        self.table[dst_rows, : table.shape[1]] = table
        self.length[dst_rows] = length


def check_invariants(allocator: SlotAllocator, tables: list[BlockTables]) -> None:
    """Every slot's refcount equals the number of block-table entries pointing at it.

    That one equality rules out leaks (refcount > 0 with no owner), frees while referenced
    (owner with refcount 0) and double frees. Raises AssertionError naming the first bad slot.
    """
    owners = torch.zeros(allocator.num_slots + 1, dtype=torch.int64, device=allocator.device)
    for bt in tables:
        table, owned = bt._owned(torch.arange(bt.max_rows + 1, device=bt.table.device), None)
        owners.index_add_(0, table.reshape(-1), owned.reshape(-1).to(torch.int64))
    owners, refcount = owners[: allocator.num_slots], allocator.refcount[: allocator.num_slots].to(torch.int64)
    bad = torch.nonzero(owners != refcount).flatten()
    if bad.numel():
        s = int(bad[0])
        raise AssertionError(
            f"KV slot {s}: refcount {int(refcount[s])} but {int(owners[s])} block-table entries "
            f"({bad.numel()} inconsistent slots)"
        )
