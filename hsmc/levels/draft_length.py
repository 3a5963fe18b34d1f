"""`num_draft_tokens: auto` and `tree: auto`: each round's draft shape, chosen for the most expected tokens per second.

The shapes ("arms") are chains of γ = 0..most drafts and, with `tree: auto`, the draft trees of AUTO_TREES. A round
of an arm costs `ms(arm, rows)`, measured on the machine at start (`HierarchicalDecoder` decodes synthetic requests
with each arm, γ = 0 being the target alone, at 1, 4, 16, ... requests and as many as the rows hold): a verify's
cost grows with its rows times its tokens, so the shape that pays at one row may not at a full batch. A chain of γ
yields 1 + α + … + α^γ tokens when each draft is kept with probability α (the i.i.d. acceptance model of Leviathan
et al., 2023). α is estimated from the chain rounds read so far, each count discounted by DECAY per row-round read,
so the choice follows acceptance as it drifts. A tree's yield is predicted as a chain of its depth whose every step
keeps one of `topk` children, 1 - (1 - α)^topk (optimistic: siblings are not independent), times what its own rounds
yielded over what that predicted for them (discounted alike), so a tree is tried and then judged by its rounds.
Drafting is chosen over the target alone only where it is predicted DRAFT_MARGIN faster. While γ = 0 wins, nothing
is observed: now and then a round drafts anyway (γ = 1, the cheapest), as seldom as keeps those probes' extra time
under PROBE_SHARE of the time, so that better acceptance is noticed. A probe's extra time counts the drafters'
catch-up (`catch_up_ms`, also measured at start): the tokens of the rounds they sat out are processed at the probe,
a cost per token however rare the probes. Where that cost alone exceeds PROBE_SHARE of a round, no probe interval
pays and γ = 0 stays until the next timing. Where that holds at every batch size timed (`never_drafts`), no round
drafts again and none is read, so nothing could change the plans but a drafting round launched before and read
after. That decision is for good, so it is taken on all the drafts read since the timing, not on the estimate that
follows the last ~33 row-rounds: only where even α's upper confidence bound (`rate_bound`) leaves every batch size's
plan at γ = 0 without probes, and after IDLE_EVIDENCE drafts read. Until then such rounds draft the chain predicted
fastest, not γ = 1: drafts are not i.i.d. (a head keeps a draft after a kept one more often than a first one), so
rounds of γ = 1 under-read the chain that would pay (docs/measurements/2026-11-29-cpu-auto-idle-trap.txt,
2026-11-29-h200-steady-timing-and-evidence.txt). Then the choice goes `idle` (γ = 0 until the times change,
whatever is read), and the rejection level leaves its drafters out of the rounds (no tokens or features handed to
them, no backlog, so no drafting round forced by an EAGLE3 head's window every 55 rounds:
docs/measurements/2026-11-29-h200-idle-drafter.txt).
The choice only ever depends on rounds already read, never on the round it is for, so every round is an ordinary
speculative-sampling round and the output stays an exact sample of the verifier's law.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from hsmc.levels.tree import TreeShape

RoundTimes = tuple[dict[int, list[float]], dict[int, float]]  # `round_ms` and `catch_up_ms`, as ranks share them

DECAY = 0.97  # weight of an observation after each later row-round: ~33 row-rounds' memory
DRAFT_MARGIN = 0.05  # drafting replaces the target alone only where predicted this much faster: the start-up
# timing's error (γ = 1 timed at 1.24x a step cost 1.29-1.59x on a 2-core CPU), and the tolerance a GPU allows
PROBE_SHARE = 0.02  # most share of the time that rounds drafting against the choice (to observe acceptance) take
PRIOR = (1.0, 1.0)  # pseudo-counts (kept, rejected) before any round is read: α = 0.5
IDLE_EVIDENCE = 32  # drafts read before the choice may go idle (the confidence bound below is an approximation)
IDLE = -1  # the arm forced for rounds of γ = 0 that leave the drafters out, as those of a choice gone idle (a warmup's)
IDLE_CONFIDENCE_Z = 1.645  # idle only where even α's one-sided 95 % upper bound (Wilson's) leaves every draft unpaid
TREE_PRIOR_TOKENS = 4.0  # a tree's yield over its prediction starts at 1 as if from rounds of this many tokens


def expected_tokens(rate: float, gamma: int) -> float:
    """Tokens a round of γ drafts yields when each draft is kept with probability `rate`: Σ_{i=0}^{γ} rate^i."""
    return sum(rate**i for i in range(gamma + 1))


def tree_tokens(rate: float, tree: TreeShape) -> float:
    """A tree's predicted yield per round: a chain of its depth whose steps keep one of `topk` children."""
    return expected_tokens(1 - (1 - rate) ** tree.topk, tree.depth)


class DraftLength:
    def __init__(self, most: int, trees: Sequence[TreeShape] = ()) -> None:
        self.most, self.trees = most, tuple(trees)
        # per (batch size, at α's upper bound): `_plan`'s, until it changes
        self._plans: dict[tuple[int, bool], tuple[int, int | None, int]] = {}
        self._round_ms: dict[int, list[float]] | None = None
        self._catch_up_ms: dict[int, float] = {}
        self.forced: int | None = None  # the arm every round takes while the rounds are timed or warmed up (or IDLE)
        self.forget()

    @property
    def round_ms(self) -> dict[int, list[float]] | None:
        """Per batch size timed (rows), each arm's round time (γ in 0..most, then each tree); None until timed."""
        return self._round_ms

    @round_ms.setter
    def round_ms(self, times: dict[int, list[float]] | None) -> None:
        self._round_ms, self._plans, self.idle = times, {}, False

    @property
    def catch_up_ms(self) -> dict[int, float]:
        """Per batch size timed: the drafters' forward time per round of γ = 0, paid when they next draft."""
        return self._catch_up_ms

    @catch_up_ms.setter
    def catch_up_ms(self, times: dict[int, float]) -> None:
        self._catch_up_ms, self._plans = times, {}

    @property
    def arms(self) -> int:
        return self.most + 1 + len(self.trees)

    def shape(self, arm: int) -> tuple[int, TreeShape | None]:
        """An arm's longest path of drafts and its tree (None: a chain of that many)."""
        if arm <= self.most:
            return arm, None
        tree = self.trees[arm - self.most - 1]
        return tree.depth, tree

    @property
    def rate(self) -> float:
        """The estimated probability that a chain's draft is kept."""
        return self.kept / (self.kept + self.rejected)

    @property
    def rate_bound(self) -> float:
        """Wilson's upper confidence bound on α from every chain draft read since the timing (undiscounted): what
        going idle for good must rule out, where the estimate (`rate`) follows only the last ~33 row-rounds."""
        kept, n, z = self.seen_kept, self.read, IDLE_CONFIDENCE_Z
        if n == 0:
            return 1.0
        share = kept / n
        margin = z * math.sqrt(share * (1 - share) / n + z * z / (4 * n * n))
        return (share + z * z / (2 * n) + margin) / (1 + z * z / n)

    def expected(self, arm: int, rate: float | None = None) -> float:
        """Tokens a round of `arm` is expected to yield per row (at `rate`, default the estimate)."""
        rate = self.rate if rate is None else rate
        depth, tree = self.shape(arm)
        if tree is None:
            return expected_tokens(rate, depth)
        got, predicted = self.tree_rounds[arm - self.most - 1]
        return tree_tokens(rate, tree) * (got + TREE_PRIOR_TOKENS) / (predicted + TREE_PRIOR_TOKENS)

    def ms(self, arm: int, rows: int) -> float:
        """An arm's round time at `rows` rows: linear between the nearest batch sizes timed (the nearest one's
        outside them)."""
        assert self.round_ms is not None
        return _between({n: ms[arm] for n, ms in self.round_ms.items()}, rows)

    def catch_up(self, rows: int) -> float:
        """The drafters' later catch-up on one round of γ = 0 at `rows` rows, in ms (0 where not timed)."""
        return _between(self.catch_up_ms, rows) if self.catch_up_ms else 0.0

    def choose(self, rows: int) -> int:
        """The arm of the next round of `rows` rows."""
        if self.forced is not None:
            return max(self.forced, 0)
        if self.round_ms is None:
            return self.most // 2
        if self.idle or self.never_drafts:
            self.idle = True  # the drafters no longer follow the rows: none of them may draft again
            return 0
        best, every, fastest_chain = self._plan_at(rows)
        if best:
            return best
        if every is None:  # no probe pays: draft while the evidence leaves room for drafting to pay (`never_drafts`)
            return fastest_chain if self.read < IDLE_EVIDENCE or self._plan_at(rows, optimistic=True)[0] else 0
        self.waited += 1
        if self.waited < every:
            return 0
        self.waited = 0
        return 1

    @property
    def drafters_out(self) -> bool:
        """Whether the next rounds leave the drafters out: the choice went idle, or IDLE is forced. A round of γ = 0
        that leaves them out is a graph of its own, which a warmup must capture too (a serving stack gone idle ran
        its rounds eagerly at 0.39x the target alone on an H200: docs/measurements/2026-11-29-h200-warmup-idle.txt).
        """
        return self.idle if self.forced is None else self.forced == IDLE

    @property
    def never_drafts(self) -> bool:
        """Whether the plan of every batch size timed is γ = 0 without probes even at α's upper bound (`rate_bound`;
        then so is that of every size between: the round and catch-up times are linear there), with IDLE_EVIDENCE
        drafts read. Not while an arm is forced (a timing, a warmup)."""
        if self.forced is not None or self.round_ms is None or self.read < IDLE_EVIDENCE:
            return False
        return all(self._plan_at(rows, optimistic=True)[:2] == (0, None) for rows in self.round_ms)

    def _plan_at(self, rows: int, optimistic: bool = False) -> tuple[int, int | None, int]:
        if (rows, optimistic) not in self._plans:
            self._plans[rows, optimistic] = self._plan(rows, self.rate_bound if optimistic else self.rate)
        return self._plans[rows, optimistic]

    def _plan(self, rows: int, rate: float) -> tuple[int, int | None, int]:
        """The arm that wins at `rows` rows if drafts are kept at `rate` (0: the target alone), for 0 the probe
        interval, and the chain (γ >= 1) predicted fastest. It changes only when a drafting round is read or the
        times are, so it is kept until then: computing it took 40 µs of Python (2-core CPU) on every round, against
        a 0.8 ms GPU round of the SmolLM2 pair."""
        speed = [self.expected(arm, rate) / self.ms(arm, rows) for arm in range(self.arms)]
        best = max(range(self.arms), key=speed.__getitem__)
        fastest_chain = max(range(1, self.most + 1), key=speed.__getitem__)
        if best and speed[best] >= (1 + DRAFT_MARGIN) * speed[0]:
            return best, None, fastest_chain
        return 0, self.probe_every(rows), fastest_chain

    def probe_every(self, rows: int) -> int | None:
        """Rounds of the target alone per probe, so that a probe's extra time, with the drafters' catch-up on those
        rounds, is at most PROBE_SHARE of theirs: W rounds cost W·t0, a probe e + W·c, so W >= e / (s·t0 - c).
        None (never probe) where the catch-up alone, c >= s·t0, takes more than the share."""
        extra = self.ms(1, rows) - self.ms(0, rows)
        room = PROBE_SHARE * self.ms(0, rows) - self.catch_up(rows)
        if room <= 0:
            return None
        return max(1, math.ceil(extra / room))

    def observe(self, arm: int, accepted: list[int]) -> None:
        """One round read: each row kept `accepted` of its arm's drafts (a chain's row that stopped short rejected
        one)."""
        depth, tree = self.shape(arm)
        if depth:
            self._plans = {}
        decay = DECAY ** len(accepted)
        if tree is not None:
            i = arm - self.most - 1
            got, predicted = self.tree_rounds[i]
            yielded, foreseen = sum(accepted) + len(accepted), len(accepted) * tree_tokens(self.rate, tree)
            self.tree_rounds[i] = (got * decay + yielded, predicted * decay + foreseen)
        elif depth:
            self.kept = self.kept * decay + sum(accepted)
            self.rejected = self.rejected * decay + sum(a < depth for a in accepted)
            self.read += sum(min(a + 1, depth) for a in accepted)
            self.seen_kept += sum(accepted)

    def forget(self) -> None:
        """Back to the prior (after the timing's synthetic requests)."""
        self.kept, self.rejected = PRIOR
        self._plans = {}
        self.tree_rounds = [(0.0, 0.0) for _ in self.trees]  # per tree: tokens yielded, tokens predicted (discounted)
        self.waited = 0  # rounds at γ = 0 since the last drafting one
        self.read = self.seen_kept = 0  # drafts of chains read (kept, or the one rejected) and those kept, undiscounted
        self.idle = False  # chose γ = 0 for good (`never_drafts` held): until the times change


def _between(times: dict[int, float], rows: int) -> float:
    """A time measured at some batch sizes, at `rows`: linear between the nearest ones, the nearest one's outside."""
    below = max((n for n in times if n <= rows), default=min(times))
    above = min((n for n in times if n >= rows), default=max(times))
    if below == above:
        return times[below]
    share = (rows - below) / (above - below)
    return (1 - share) * times[below] + share * times[above]
