"""Admission: when a request joins the running batch, so that the rows and KV slots it may need fit."""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Hashable, Sequence

from hsmc.config import HsmcConfig, LevelConfig
from hsmc.errors import KVCapacityError


class Admission:
    """Continuous batching: requests wait in order and join the running batch between two steps (cycles) as soon
    as a group of rows and the KV slots they may need are free; a finished request gives both back.

    A request's group is `group_size` consecutive rows (an SMC request's N particles; a request with fewer uses
    the group's first rows); the lowest free group is taken first, so the active rows stay few and dense. The
    group size changes only while nothing runs: then it becomes the most rows any waiting request asks for (at
    least `default_group`), so requests of different N submitted together decode together. Slots are reserved
    for the whole request: its prompt, shared by its rows, plus each row's growth by its max_tokens + lookahead
    (tokens proposed past the end before they are rejected), so a running request never runs out. First come,
    first served: a request that does not fit yet holds back those behind it, so none waits forever. `problem`
    says why a request could never fit on its own, before it is queued."""

    def __init__(self, max_rows: int, capacity: int, lookahead: int, default_group: int = 1) -> None:
        self.max_rows, self.capacity, self.lookahead = max_rows, capacity, lookahead
        self.default_group = default_group
        self.waiting: deque[Hashable] = deque()
        self.needs: dict[Hashable, int] = {}
        self.rows: dict[Hashable, int] = {}
        self.group_of: dict[Hashable, int] = {}  # admitted, unfinished request -> its row group
        self.group_size = 0
        self._resize(default_group)

    def need(self, prompt_tokens: int, max_tokens: int, rows: int) -> int:
        """KV slots a request reserves: its prompt, shared, and every row's growth."""
        return prompt_tokens + rows * (max_tokens + self.lookahead)

    def problem(self, prompt_tokens: int, max_tokens: int, rows: int) -> str | None:
        """Why a request of these sizes could never be admitted, or None."""
        need = self.need(prompt_tokens, max_tokens, rows)
        if rows > self.max_rows:
            return f"with {rows} particles it needs {rows} rows, more than engine.max_batch_rows={self.max_rows}"
        if need > self.capacity:
            return (
                f"with max_new_tokens={max_tokens} (+{self.lookahead} lookahead) and {rows} row(s) it needs {need} "
                f"KV slots, more than engine.kv_capacity_tokens={self.capacity}"
            )
        return None

    def check(self, prompt_lengths: Sequence[int], max_tokens: Sequence[int], rows: Sequence[int]) -> None:
        """KVCapacityError naming the first prompt that could never be admitted."""
        for i, (n, m, r) in enumerate(zip(prompt_lengths, max_tokens, rows)):
            problem = self.problem(n, m, r)
            if problem is not None:
                raise KVCapacityError(f"prompt {i} has {n} tokens; {problem}")

    def add(self, key: Hashable, prompt_tokens: int, max_tokens: int, rows: int) -> None:
        """Queue a request (`problem` must have found nothing)."""
        self.needs[key] = self.need(prompt_tokens, max_tokens, rows)
        self.rows[key] = rows
        self.waiting.append(key)

    def admit(self) -> list[tuple[Hashable, int]]:
        """(request, row group) of each waiting request that fits now, in order."""
        if not self.group_of and self.waiting:
            self._resize(max(self.default_group, *(self.rows[k] for k in self.waiting)))
        admitted = []
        while self.waiting and self.free_groups and self.needs[self.waiting[0]] <= self.free_slots:
            if self.rows[self.waiting[0]] > self.group_size:  # waits until nothing runs
                break
            key, group = self.waiting.popleft(), self.free_groups.pop(0)
            self.free_slots -= self.needs[key]
            self.group_of[key] = group
            admitted.append((key, group))
        return admitted

    def finish(self, key: Hashable) -> None:
        """Request `key` is done (or cancelled): its rows and slots are free for the next ones."""
        if key in self.group_of:
            bisect.insort(self.free_groups, self.group_of.pop(key))
            self.free_slots += self.needs[key]
        elif key in self.waiting:
            self.waiting.remove(key)
        self.needs.pop(key, None)
        self.rows.pop(key, None)

    def _resize(self, group_size: int) -> None:
        group_size = min(group_size, self.max_rows)
        if group_size != self.group_size:
            self.group_size = group_size
            self.free_groups = list(range(self.max_rows // group_size))
        self.free_slots = self.capacity

    @property
    def running(self) -> int:
        return len(self.group_of)


def lookahead_tokens(levels: Sequence[LevelConfig]) -> int:
    """Drafts not yet verified, SMC blocks not yet weighed, the surplus a rejection level buffers while it
    fills an SMC block, and the step (cycle) the driver runs past a row's (group's) end while it reads the
    previous one (see `hsmc.engine.driver`); finished SMC particles ride along with their group."""
    rejection = sum(c.verify_positions for c in levels if c.kind == "rejection")
    top = levels[-1]
    fill = top.block_size if top.kind == "smc" and len(levels) > 1 and levels[-2].kind == "rejection" else 0
    overlap = {"smc": top.block_size + 1, "rejection": top.path_length + 1}.get(top.kind, 1)
    return rejection + fill + overlap + sum(c.block_size + 1 for c in levels if c.kind == "smc")


def rows_and_lookahead(cfg: HsmcConfig) -> tuple[int, int]:
    """KV rows per prompt and tokens a row may hold past its output, from the config alone (the
    built stack reports the same through `Stack.rows_per_prompt` and `Stack.lookahead`)."""
    top = cfg.levels[-1]
    rows = top.particles if top.kind == "smc" else 1
    return rows, lookahead_tokens(cfg.levels)


def minimum_kv_tokens(cfg: HsmcConfig) -> int:
    """Slots one prompt's rows need beyond the prompt itself: the least an auto-sized pool must hold."""
    rows, lookahead = rows_and_lookahead(cfg)
    return rows * (cfg.generation.max_new_tokens + lookahead)
