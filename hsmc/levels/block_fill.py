"""How many draft/verify rounds a `rejection` level under `smc` runs to fill an SMC block, decided without
reading the device in the cycle.

The SMC level asks for exactly K tokens per particle. Each round yields 1..γ+1 tokens per row, so how many
rounds a row needs is random; asking the device after every round would cost a host read each time. Instead
the level runs a host-chosen number of rounds R per block. Rows already full idle through masks; the surplus
stays buffered for the next block. A row still short after R rounds does not stop the cycle: its group's SMC
step is deferred (skipped on the device, the group waits) and the next cycle's rounds complete it. Deferral
only delays a step, so the output distribution is unchanged — but a deferred cycle wastes its target verify
and its rounds, so R trades rounds against deferrals.

R minimizes the expected cost per emitted block, (R + v) / (1 − P(group deferred | R)), in units of one round,
where v is what the rest of the cycle (the target verify) costs in rounds, from the weight bytes each reads
(`verify_rounds`, set by the smc level). A group of N particles steps when all its rows are full:
P(deferred) = 1 − (1 − p)^N, p = P(a row's R yields sum to < K), computed exactly for i.i.d. yields with the
law the level measures — a device histogram of the tokens each row-round emitted, which rides along with
the cycle's read (before the first read: yields uniform on 1..γ+1). The surplus rows carry from the last
block is left out, which errs toward a round more. The earlier rule, ceil(K / mean) + 1 rounds, deferred
28-43 % of the cycles of [EAGLE3 head, rejection 8B, smc 32B or 14B] with random weights (1.16 tokens per round,
K = 16, N = 6); planned, 10 %, and 1.27-1.38x the tok/s (docs/engine.md).

The number of rounds for the next block (`planned`, for the SMC level's K, which it sets as `block`) is a
host int a captured SMC cycle is keyed by; the blocks and rounds counted are statistics it advances. Every R in
`choices(K)` is the plan of some law (all 13 are for K = 16, γ = 4, N = 6), and real traffic's law is not a
warmup's synthetic one: a warmup runs each R in turn (`forced`), so that each has its cycle graphs.
"""

from __future__ import annotations

from functools import lru_cache

import torch


def short_probabilities(k: int, law: tuple[float, ...]) -> list[float]:
    """For R = 1..k: P(the sum of R i.i.d. yields is below k), a yield being i + 1 with probability law[i]."""
    below = [1.0] + [0.0] * (k - 1)  # below[s]: P(the yields so far sum to s), for s < k
    short = []
    for _ in range(k):
        below = [sum(below[s - 1 - i] * p for i, p in enumerate(law[:s])) for s in range(k)]
        short.append(sum(below))
    return short


@lru_cache(maxsize=256)
def plan_rounds(k: int, law: tuple[float, ...], rows: int, verify_rounds: float) -> tuple[int, float]:
    """The rounds R in 1..k that minimize (R + verify_rounds) / (1 − P(deferred)) for a group of `rows` rows
    with i.i.d. yields of `law`, and that P(deferred). R = k never defers (each round yields at least one)."""
    best = (float("inf"), k, 0.0)
    for r, short in enumerate(short_probabilities(k, law), 1):
        deferred = 1.0 - (1.0 - short) ** rows
        if deferred < 1.0:
            best = min(best, ((r + verify_rounds) / (1.0 - deferred), r, deferred))
    return best[1], best[2]


def geometric_yield_law(mean: float, gamma: int) -> tuple[float, ...]:
    """The law of a round's yield 1 + min(G, γ), G geometric with the per-draft acceptance β that gives this
    mean (Σ_{i=0}^{γ} β^i = mean): speculative sampling's i.i.d. acceptance model, for a stated accepted length."""
    mean = min(max(mean, 1.0), gamma + 1.0)
    lo, hi = 0.0, 1.0
    for _ in range(60):  # the mean grows with β: bisection
        beta = (lo + hi) / 2
        lo, hi = (beta, hi) if sum(beta**i for i in range(gamma + 1)) < mean else (lo, beta)
    beta = (lo + hi) / 2
    return tuple(beta**i * (1 - beta) for i in range(gamma)) + (beta**gamma,)


class BlockFill:
    def __init__(self, gamma: int, yields: torch.Tensor, round_bytes: int) -> None:
        """`yields`: the level's device histogram [γ+1] of row-rounds by tokens emitted (entry i: i + 1
        tokens); `round_bytes`: the weight bytes one round reads."""
        self.gamma = gamma
        self.yields = yields
        self.round_bytes = round_bytes
        self.block = 0  # K of the smc level above (set by it)
        self.rows = 1  # particles per group of the smc level above (set by it for each run)
        self.verify_rounds = 1.0  # the rest of the smc cycle in rounds: its weight bytes / round_bytes (set by it)
        self.law = (1 / (gamma + 1),) * (gamma + 1)  # before the first read: yields uniform on 1..γ+1
        self.forced: int | None = None  # rounds every block runs instead of the plan's (a warmup's)
        self.reset()

    @property
    def planned(self) -> int:
        """Rounds the next block of the smc level above will run."""
        return self.rounds_for(self.block)

    def rounds_for(self, k: int) -> int:
        """Rounds for a block of k tokens (at least 1; a row already holding k only idles)."""
        if self.forced is not None:
            return self.forced
        return plan_rounds(k, self.law, self.rows, self.verify_rounds)[0]

    def choices(self, k: int) -> range:
        """Every R a plan for a block of k tokens may take, whatever the law: fewer than ceil(k / (γ+1)) rounds
        never fill it, k rounds always do."""
        return range(-(-k // (self.gamma + 1)), k + 1)

    def rounds(self, k: int) -> int:
        """Rounds to run for a block of k tokens now, counted."""
        n = self.rounds_for(k)
        self.blocks += 1
        self.rounds_run += n
        return n

    def counters(self) -> list[torch.Tensor]:
        """Device values for the cycle's packed read; `observe` takes them back."""
        return [self.yields]

    def observe(self, values: list[list[float]]) -> None:
        (counts,) = values
        total = sum(counts)
        if total > 0:
            self.law = tuple(c / total for c in counts)

    def reset(self) -> None:
        """Zero the counts of blocks and rounds. The law stays: it belongs to the models, and which rounds a block
        runs changes no request's output (their draws are keyed per position, `random_streams`)."""
        self.blocks = self.rounds_run = 0  # host counts: blocks filled, rounds run for them

    def mean_rounds(self) -> float:
        return self.rounds_run / max(self.blocks, 1)
