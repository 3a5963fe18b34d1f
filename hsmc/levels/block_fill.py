"""How many draft/verify rounds a `rejection` level under `smc` runs to fill an SMC block, decided without
reading the device in the cycle.

The SMC level asks for exactly K tokens per particle. Each round yields 1..γ+1 tokens per row, so how many
rounds a row needs is random; asking the device after every round would cost a host read each time. Instead
the level runs a host-chosen number of rounds per block, ceil(K / tokens per round) + margin, from the
measured tokens per round (device counters that ride along with the SMC cycle's one read). Rows already full
idle through masks; the surplus stays buffered for the next block. A row still short after those rounds
does not stop the cycle: its group's SMC step is deferred (skipped on the device, the group waits) and the
next cycle's rounds complete it. Deferral only delays a step, so the output distribution is unchanged.

The number of rounds for the next block (`planned`, for the SMC level's K, which it sets as `block`) is a
host int a captured SMC cycle is keyed by; the blocks and rounds counted are statistics it advances.
"""

from __future__ import annotations

import math

import torch


class BlockFill:
    def __init__(self, gamma: int, cycles: torch.Tensor, emitted: torch.Tensor, margin: int = 1) -> None:
        """`cycles`, `emitted`: the level's device counters of row-rounds run and tokens they emitted."""
        self.gamma = gamma
        self.margin = margin  # rounds beyond the expected need (tests lower it to force deferrals)
        self.block = 0  # K of the smc level above (set by it)
        self.cycles, self.emitted = cycles, emitted
        self.reset()

    @property
    def planned(self) -> int:
        """Rounds the next block of the smc level above will run."""
        return self.rounds_for(self.block)

    def rounds_for(self, k: int) -> int:
        """Rounds for a block of k tokens (at least 1; a row already holding k only idles)."""
        return max(1, math.ceil(k / self.per_round) + self.margin)

    def rounds(self, k: int) -> int:
        """Rounds to run for a block of k tokens now, counted."""
        n = self.rounds_for(k)
        self.blocks += 1
        self.rounds_run += n
        return n

    def counters(self) -> list[torch.Tensor]:
        """Device values for the cycle's packed read; `observe` takes them back."""
        return [self.cycles, self.emitted]

    def observe(self, values: list[float]) -> None:
        cycles, emitted = values
        if cycles > 0:
            self.per_round = emitted / cycles

    def reset(self) -> None:
        """Start a run from the prior (half the drafts kept), so a run depends on its seed only."""
        self.per_round = (self.gamma + 2) / 2
        self.blocks = self.rounds_run = 0  # host counts: blocks filled, rounds run for them

    def mean_rounds(self) -> float:
        return self.rounds_run / max(self.blocks, 1)
