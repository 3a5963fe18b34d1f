"""Predicted speed of a level stack from the time of one forward of each level and the acceptance.

One step of the top level costs what its forward costs plus what the levels below spend to produce the
tokens it consumes:
- `model` / `eagle3` produce k tokens per row with k forwards (an EAGLE3 round: one forward over the new
  pairs, then a forward per further draft);
- `rejection` produces tokens in rounds of (γ drafts from below + one verify; a graphed round is measured
  whole); a round yields the accepted length a (accepted drafts + 1) per row. Under `smc` it fills a block
  of K in ceil(K / a) + margin rounds (`BlockFill`); under another rejection level, in ceil(k / (γ + 1))
  rounds; as a streaming top, one round per step, a tokens;
- `smc` consumes K proposals, runs one target verify, and emits K + 1 tokens per particle, except in a
  deferred cycle (its block was short), which emits none; a graphed cycle is measured whole.
With each forward's time set to its weight bytes / memory bandwidth the same recursion gives the
weight-read roofline bound of a step (batch 1 reads every weight once per forward).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class LevelCost:
    kind: str  # model | eagle3 | rejection | smc
    forward_ms: float  # one forward of this level's model over the batch (draft step, verify, target verify)
    gamma: int = 0  # rejection: drafts per round
    accepted_length: float = 1.0  # rejection: tokens per round per row (accepted drafts + 1)
    fill_margin: int = 1  # rejection under smc: rounds beyond ceil(K / accepted_length)
    block_size: int = 0  # smc: K
    deferral_rate: float = 0.0  # smc: share of cycles deferred (no tokens)
    round_includes_drafts: bool = False  # rejection: forward_ms is a whole (graphed) round, the drafter's steps in it
    cycle_includes_proposal: bool = False  # smc: forward_ms is a whole (graphed) cycle, the proposal's in it


@dataclass(frozen=True)
class Prediction:
    step_ms: float  # one step (SMC cycle, verify cycle, decode step) of the top level
    tokens_per_step: float  # per row (request)

    @property
    def tokens_per_s(self) -> float:
        return 1000 * self.tokens_per_step / self.step_ms if self.step_ms > 0 else 0.0


def rejection_rounds(level: LevelCost, k: int, under_smc: bool) -> int:
    """Rounds a rejection level runs to hand k tokens per row to the level above."""
    if under_smc:
        return max(1, math.ceil(k / level.accepted_length) + level.fill_margin)
    return math.ceil(k / (level.gamma + 1))


def production_ms(levels: list[LevelCost], k: int, under_smc: bool = False) -> float:
    """Time for the stack `levels` (bottom to top) to produce k tokens per row for the level above it."""
    *below, top = levels
    if top.kind in ("model", "eagle3"):
        return k * top.forward_ms
    if top.kind != "rejection":
        raise ValueError(f"a {top.kind!r} level does not propose to a level above")
    return rejection_rounds(top, k, under_smc) * round_ms(levels)


def round_ms(levels: list[LevelCost]) -> float:
    """One round of the rejection level on top of `levels`: its drafter's γ tokens and its verify."""
    *below, top = levels
    return top.forward_ms if top.round_includes_drafts else production_ms(below, top.gamma) + top.forward_ms


def predict(levels: list[LevelCost]) -> Prediction:
    """Step time and tokens per row of the stack's top level."""
    *below, top = levels
    if top.kind == "smc":
        k = top.block_size
        fill = production_ms(below, k, under_smc=True) if k and not top.cycle_includes_proposal else 0.0
        return Prediction(fill + top.forward_ms, (k + 1) * (1 - top.deferral_rate))
    if top.kind == "rejection":
        return Prediction(round_ms(levels), top.accepted_length)
    return Prediction(top.forward_ms, 1.0)


def roofline(levels: list[LevelCost], weight_ms: list[float]) -> Prediction:
    """The same stack with every forward taking `weight_ms` (its weights read once at the memory bandwidth)."""
    return predict(
        [
            replace(level, forward_ms=ms, round_includes_drafts=False, cycle_includes_proposal=False)
            for level, ms in zip(levels, weight_ms)
        ]
    )


def with_accepted_length(levels: list[LevelCost], accepted_length: float) -> list[LevelCost]:
    """Every rejection level at a stated accepted length (e.g. a real EAGLE3 head's 3-4 tokens per verify)."""
    return [replace(lv, accepted_length=accepted_length) if lv.kind == "rejection" else lv for lv in levels]
