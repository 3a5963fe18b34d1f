"""Admission: when a prompt joins the running batch, so that the rows and KV slots it may need fit."""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence

from hsmc.config import HsmcConfig, LevelConfig
from hsmc.errors import KVCapacityError


class Admission:
    """Continuous batching: prompts wait in order and join the running batch between two steps (cycles)
    as soon as a group of rows and the KV slots they may need are free; a finished request gives both back.

    A prompt's group is as many consecutive rows as the most any prompt of the call asks for (an SMC request's
    N particles; requests with fewer use the group's first rows); the lowest free group is taken first, so the
    active rows stay few and dense. Slots are reserved for the whole request: its prompt, shared by its rows,
    plus each row's growth by max_new_tokens + lookahead (tokens proposed past the end before they are
    rejected), so a running request never runs out. First come, first served: a prompt that does not fit yet
    holds back those behind it, so none waits forever. A prompt that could never fit on its own raises
    KVCapacityError, naming it, before any work starts (preflight builds one for that check alone)."""

    def __init__(
        self,
        prompt_lengths: Sequence[int],
        max_new_tokens: int,
        max_rows: int,
        capacity: int,
        rows_per_prompt: int | Sequence[int] = 1,
        lookahead: int = 0,
    ) -> None:
        grow = max_new_tokens + lookahead
        rows = [rows_per_prompt] * len(prompt_lengths) if isinstance(rows_per_prompt, int) else list(rows_per_prompt)
        group = max(rows, default=1)
        self.needs = [n + r * grow for n, r in zip(prompt_lengths, rows)]
        for i, (n, r, need) in enumerate(zip(prompt_lengths, rows, self.needs)):
            if need > capacity or group > max_rows:
                raise KVCapacityError(
                    f"prompt {i} has {n} tokens; with max_new_tokens={max_new_tokens} (+{lookahead} lookahead) "
                    f"and {r} row(s) (in groups of {group}) it needs {need} KV slots and {group} rows, more than "
                    f"engine.kv_capacity_tokens={capacity} / engine.max_batch_rows={max_rows}"
                )
        self.waiting = deque(range(len(prompt_lengths)))
        self.free_groups = list(range(max_rows // group))
        self.free_slots = capacity
        self.group_of: dict[int, int] = {}  # admitted, unfinished prompt -> its row group

    def admit(self) -> list[tuple[int, int]]:
        """(prompt index, row group) of each waiting prompt that fits now, in order."""
        admitted = []
        while self.waiting and self.free_groups and self.needs[self.waiting[0]] <= self.free_slots:
            index, group = self.waiting.popleft(), self.free_groups.pop(0)
            self.free_slots -= self.needs[index]
            self.group_of[index] = group
            admitted.append((index, group))
        return admitted

    def finish(self, index: int) -> None:
        """Prompt `index` is done: its rows and slots are free for the next ones."""
        bisect.insort(self.free_groups, self.group_of.pop(index))
        self.free_slots += self.needs[index]

    @property
    def busy(self) -> bool:
        """Some prompt still waits or runs."""
        return bool(self.waiting or self.group_of)


def lookahead_tokens(levels: Sequence[LevelConfig]) -> int:
    """Drafts not yet verified, SMC blocks not yet weighed, the surplus a rejection level buffers while it
    fills an SMC block, and the step (cycle) the decoder runs past a row's (group's) end while it reads the
    previous one (see `HierarchicalDecoder`, `SMCLevel`); finished SMC particles ride along with their group."""
    rejection = sum(c.num_draft_tokens + 1 for c in levels if c.kind == "rejection")
    top = levels[-1]
    fill = top.block_size if top.kind == "smc" and len(levels) > 1 and levels[-2].kind == "rejection" else 0
    overlap = {"smc": top.block_size + 1, "rejection": top.num_draft_tokens + 1}.get(top.kind, 1)
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
