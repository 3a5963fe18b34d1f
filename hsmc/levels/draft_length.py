"""`num_draft_tokens: auto`: each round's γ, chosen for the most expected tokens per second.

A round of γ drafts costs `round_ms[γ]` (measured on the machine at start: `HierarchicalDecoder` decodes a
synthetic request at each γ, γ = 0 being the target alone) and yields 1 + α + … + α^γ tokens when each draft is
kept with probability α (the i.i.d. acceptance model of Leviathan et al., 2023). α is estimated from the rounds
read so far, each count discounted by DECAY per row-round read, so the choice follows acceptance as it drifts.
While γ = 0 wins, nothing is observed: now and then a round drafts anyway (γ = 1, the cheapest), as seldom as keeps
those probes' extra time under PROBE_SHARE of the time, so that better acceptance is noticed. The choice only ever
depends on rounds already read, never on the round it is for, so every round is an ordinary speculative-sampling
round and the output stays an exact sample of the verifier's law.
"""

from __future__ import annotations

import math

DECAY = 0.97  # weight of an observation after each later row-round: ~33 row-rounds' memory
PROBE_SHARE = 0.02  # most share of the time that rounds drafting against the choice (to observe acceptance) take
PRIOR = (1.0, 1.0)  # pseudo-counts (kept, rejected) before any round is read: α = 0.5


def expected_tokens(rate: float, gamma: int) -> float:
    """Tokens a round of γ drafts yields when each draft is kept with probability `rate`: Σ_{i=0}^{γ} rate^i."""
    return sum(rate**i for i in range(gamma + 1))


class DraftLength:
    def __init__(self, most: int) -> None:
        self.most = most
        self.round_ms: list[float] | None = None  # per γ in 0..most; None until timed (then γ = most // 2)
        self.forced: int | None = None  # the γ every round takes while the rounds are timed
        self.kept, self.rejected = PRIOR
        self.waited = 0  # rounds at γ = 0 since the last drafting one

    @property
    def rate(self) -> float:
        """The estimated probability that a draft is kept."""
        return self.kept / (self.kept + self.rejected)

    def choose(self) -> int:
        """The γ of the next round."""
        if self.forced is not None:
            return self.forced
        if self.round_ms is None:
            return self.most // 2
        speed = [expected_tokens(self.rate, g) / ms for g, ms in enumerate(self.round_ms)]
        best = max(range(self.most + 1), key=speed.__getitem__)
        if best:
            return best
        self.waited += 1
        if self.waited < self.probe_every:
            return 0
        self.waited = 0
        return 1

    @property
    def probe_every(self) -> int:
        """Rounds of the target alone per probe: a probe's extra time is at most PROBE_SHARE of theirs."""
        extra = self.round_ms[1] - self.round_ms[0]  # type: ignore[index]
        return max(1, math.ceil(extra / (PROBE_SHARE * self.round_ms[0])))  # type: ignore[index]

    def observe(self, gamma: int, accepted: list[int]) -> None:
        """One round read: each row kept `accepted` of its γ drafts (a row that stopped short rejected one)."""
        if gamma == 0:
            return
        decay = DECAY ** len(accepted)
        self.kept = self.kept * decay + sum(accepted)
        self.rejected = self.rejected * decay + sum(a < gamma for a in accepted)

    def forget(self) -> None:
        """Back to the prior (after the timing's synthetic requests)."""
        self.kept, self.rejected = PRIOR
        self.waited = 0
