"""Token slots, their refcounts, and per-row block tables.

Every model of a stack stores the KV of a token at the same *slot id* in its own cache
(`KVCache`), so one set of refcounts serves all models' pools. A row (a request, or one SMC
particle) owns a block table: position -> slot id, page size 1. Forking a row (fan-out of a
prompt to N particles, resampling) copies slot ids and bumps refcounts: no KV byte moves.

All state lives in tensors on the engine's device and every operation is written as tensor
ops with shapes fixed by its arguments: no Python loop over rows, no host sync, so the same
code can later run inside a captured CUDA graph. A slot is free exactly when its refcount is 0;
allocation takes the lowest-numbered free slots through a cumulative sum, so there is no free
list to keep consistent. Misuse (out of slots, table overflow, double free) is caught by
`torch._assert_async`, which raises immediately on CPU and without a sync on GPU.
"""

from __future__ import annotations

import torch


class SlotAllocator:
    """Refcounted token slots shared by every model's KV cache."""

    def __init__(self, num_slots: int, device: torch.device | str = "cpu") -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.num_slots = num_slots
        self.refcount = torch.zeros(num_slots, dtype=torch.int32, device=device)

    @property
    def device(self) -> torch.device:
        return self.refcount.device

    def num_free(self) -> int:
        """Host-side count of free slots (syncs: for admission control and tests, not the hot path)."""
        return int((self.refcount == 0).sum())

    def alloc(self, n: int) -> torch.Tensor:
        """Take `n` free slots (refcount 0 -> 1) and return their ids, int64 [n]."""
        free_before = torch.cumsum((self.refcount == 0).to(torch.int64), 0)
        slots = torch.searchsorted(free_before, torch.arange(1, n + 1, device=self.device))
        torch._assert_async((slots < self.num_slots).all(), "KV pool out of slots: raise engine.kv_capacity_tokens")
        slots = slots.clamp_max(self.num_slots - 1)
        self.refcount[slots] = 1
        return slots

    def inc_ref(self, slots: torch.Tensor) -> None:
        """One more owner for each entry of `slots` (duplicates count once per occurrence)."""
        self.refcount.index_add_(0, slots.reshape(-1), torch.ones_like(slots.reshape(-1), dtype=torch.int32))

    def dec_ref_and_free(self, slots: torch.Tensor) -> None:
        """One owner fewer per entry; a slot whose last owner lets go becomes free."""
        flat = slots.reshape(-1)
        self.refcount.index_add_(0, flat, torch.full_like(flat, -1, dtype=torch.int32))
        torch._assert_async((self.refcount >= 0).all(), "KV slot released more often than it was referenced")

    def free(self, slots: torch.Tensor) -> None:
        """Free slots the caller owns alone (refcount exactly 1)."""
        flat = slots.reshape(-1)
        torch._assert_async((self.refcount[flat] == 1).all(), "free() on a KV slot that is shared or already free")
        self.refcount[flat] = 0


class BlockTables:
    """Per-row position -> slot tables over one `SlotAllocator`.

    `table[row, :length[row]]` are the row's slots; entries past `length` are stale and never read
    for attention (causality masks them), so rollback only lowers `length`.
    """

    def __init__(self, allocator: SlotAllocator, max_rows: int, max_row_tokens: int) -> None:
        self.allocator = allocator
        self.max_rows = max_rows
        self.max_row_tokens = max_row_tokens
        device = allocator.device
        self.table = torch.zeros(max_rows, max_row_tokens, dtype=torch.int64, device=device)
        self.length = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self._positions = torch.arange(max_row_tokens, device=device)

    def _owned(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' table prefix [R, W] up to their longest length, and the mask of owned entries.

        Reads W on the host: release and fork run once per request or resampling, not per token,
        and scanning only W columns instead of the whole table is what keeps them cheap.
        """
        length = self.length[rows]
        width = int(length.max()) if rows.numel() else 0
        return self.table[rows, :width], self._positions[None, :width] < length[:, None]

    def append(self, rows: torch.Tensor, n: int) -> torch.Tensor:
        """Allocate `n` new slots at the end of each row; returns them as [R, n]."""
        start = self.length[rows]
        torch._assert_async(
            (start + n <= self.max_row_tokens).all(), "row longer than its block table (engine.kv_capacity_tokens)"
        )
        slots = self.allocator.alloc(rows.numel() * n).view(rows.numel(), n)
        cols = (start[:, None] + torch.arange(n, device=rows.device)).clamp_max(self.max_row_tokens - 1)
        self.table[rows[:, None], cols] = slots
        self.length[rows] = start + n
        return slots

    def rollback(self, rows: torch.Tensor, counts: torch.Tensor, max_count: int) -> None:
        """Drop the last `counts[i]` tokens of `rows[i]` (0 <= counts <= max_count, a static bound)."""
        end = self.length[rows]
        torch._assert_async(((counts >= 0) & (counts <= end) & (counts <= max_count)).all(), "bad rollback count")
        back = torch.arange(1, max_count + 1, device=rows.device)
        cols = end[:, None] - back[None, :]  # [R, max_count], last position first
        dropped = back[None, :] <= counts[:, None]
        slots = self.table[rows[:, None], cols.clamp_min(0)]
        self.allocator.dec_ref_and_free(slots[dropped])
        self.length[rows] = end - counts

    def release(self, rows: torch.Tensor) -> None:
        """Give up every slot of `rows`; they become empty rows."""
        table, owned = self._owned(rows)
        self.allocator.dec_ref_and_free(table[owned])
        self.length[rows] = 0

    def copy_block_table(self, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
        """dst[i] becomes a copy of src[i], sharing its slots. Safe when src and dst overlap
        (a resampling permutation): the sources are read and referenced before dst lets go."""
        table, owned = self._owned(src_rows)
        length = self.length[src_rows]
        self.allocator.inc_ref(table[owned])
        self.release(dst_rows)
        self.table[dst_rows, : table.shape[1]] = table
        self.length[dst_rows] = length


def check_invariants(allocator: SlotAllocator, tables: list[BlockTables]) -> None:
    """Every slot's refcount equals the number of block-table entries pointing at it.

    That one equality rules out leaks (refcount > 0 with no owner), frees while referenced
    (owner with refcount 0) and double frees. Raises AssertionError naming the first bad slot.
    """
    owners = torch.zeros(allocator.num_slots, dtype=torch.int64, device=allocator.device)
    for bt in tables:
        table, owned = bt._owned(torch.arange(bt.max_rows, device=bt.table.device))
        owners += torch.bincount(table[owned], minlength=allocator.num_slots)
    bad = torch.nonzero(owners != allocator.refcount.to(torch.int64)).flatten()
    if bad.numel():
        s = int(bad[0])
        raise AssertionError(
            f"KV slot {s}: refcount {int(allocator.refcount[s])} but {int(owners[s])} block-table entries "
            f"({bad.numel()} inconsistent slots)"
        )
