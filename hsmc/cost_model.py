"""Predicted speed of a level stack from the time of one forward of each level and the acceptance.

One step of the top level costs what its forward costs plus what the levels below spend to produce the
tokens it consumes:
- `model` / `eagle3` produce k tokens per row with k forwards (an EAGLE3 round: one forward over the new
  pairs, then a forward per further draft);
- `rejection` produces tokens in rounds of (γ drafts from below + one verify; a graphed round is measured
  whole); a round yields the accepted length a (accepted drafts + 1) per row. Under `smc` it fills a block
  of K in the rounds measured, or in those `BlockFill` plans at accepted length a (the i.i.d. acceptance
  model's yields; the target verify priced at its measured time in rounds); under another rejection level,
  in ceil(k / (γ + 1)) rounds; as a streaming top, one round per step, a tokens;
- `smc` consumes K proposals, runs one target verify, and emits K + 1 tokens per particle, except in a
  deferred cycle (its block was short), which emits none: the share measured, or the plan's; a graphed cycle
  is measured whole.
With each forward's time set to its weight bytes / memory bandwidth the same recursion gives the
weight-read roofline bound of a step (batch 1 reads every weight once per forward).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from hsmc.levels.block_fill import geometric_yield_law, plan_rounds


@dataclass(frozen=True)
class LevelCost:
    kind: str  # model | eagle3 | rejection | smc
    forward_ms: float  # one forward of this level's model over the batch (draft step, verify, target verify)
    gamma: float = 0  # rejection: drafts per round (a tree's depth; a chosen shape's mean)
    accepted_length: float = 1.0  # rejection: tokens per round per row (accepted drafts + 1)
    fill_rounds: float | None = None  # rejection under smc: rounds per block (None: as `BlockFill` plans them)
    block_size: int = 0  # smc: K
    particles: int = 1  # smc: N, the rows a block fill must fill before a group steps
    deferral_rate: float | None = None  # smc: share of cycles deferred, no tokens (None: the block fill's plan)
    round_includes_drafts: bool = False  # rejection: forward_ms is a whole (graphed) round, the drafter's steps in it
    cycle_includes_proposal: bool = False  # smc: forward_ms is a whole (graphed) cycle, the proposal's in it


@dataclass(frozen=True)
class Prediction:
    step_ms: float  # one step (SMC cycle, verify cycle, decode step) of the top level
    tokens_per_step: float  # per row (request)

    @property
    def tokens_per_s(self) -> float:
        return 1000 * self.tokens_per_step / self.step_ms if self.step_ms > 0 else 0.0


def block_fill(proposal: list[LevelCost], smc: LevelCost) -> tuple[float, float]:
    """Rounds per block and share of cycles deferred when a rejection level (on top of `proposal`) fills the
    smc level's blocks: as measured where given, else as `BlockFill` plans them at the accepted length."""
    rejection = proposal[-1]
    measured = (rejection.fill_rounds, smc.deferral_rate)
    if None not in measured:
        return measured
    if smc.cycle_includes_proposal:
        raise ValueError("a graphed cycle's time holds its rounds: plan a block fill from an eager cycle's times")
    law = geometric_yield_law(rejection.accepted_length, rejection.gamma)
    planned = plan_rounds(smc.block_size, law, smc.particles, smc.forward_ms / round_ms(proposal))
    return tuple(p if m is None else m for m, p in zip(measured, planned))


def production_ms(levels: list[LevelCost], k: int, fill_rounds: float | None = None) -> float:
    """Time for the stack `levels` (bottom to top) to produce k tokens per row for the level above it
    (`fill_rounds`: a rejection top's rounds for an smc level's block)."""
    *below, top = levels
    if top.kind in ("model", "eagle3"):
        return k * top.forward_ms
    if top.kind != "rejection":
        raise ValueError(f"a {top.kind!r} level does not propose to a level above")
    rounds = fill_rounds if fill_rounds is not None else math.ceil(k / (top.gamma + 1))
    return rounds * round_ms(levels)


def round_ms(levels: list[LevelCost]) -> float:
    """One round of the rejection level on top of `levels`: its drafter's γ tokens and its verify."""
    *below, top = levels
    return top.forward_ms if top.round_includes_drafts else production_ms(below, top.gamma) + top.forward_ms


def predict(levels: list[LevelCost]) -> Prediction:
    """Step time and tokens per row of the stack's top level."""
    *below, top = levels
    if top.kind == "smc":
        k, rounds, deferred = top.block_size, None, top.deferral_rate or 0.0
        if k and below[-1].kind == "rejection":
            rounds, deferred = block_fill(below, top)
        fill = production_ms(below, k, rounds) if k and not top.cycle_includes_proposal else 0.0
        return Prediction(fill + top.forward_ms, (k + 1) * (1 - deferred))
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
    """Every rejection level at a stated accepted length (e.g. a real EAGLE3 head's 3-4 tokens per verify), its
    block fill's rounds and deferrals as planned at that length rather than as measured."""
    stated = {"rejection": dict(accepted_length=accepted_length, fill_rounds=None), "smc": dict(deferral_rate=None)}
    return [replace(lv, **stated.get(lv.kind, {})) for lv in levels]
