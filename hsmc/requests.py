"""What a request asks for (`SamplingParams`) and what it gives back (`Increment`s, then a `Result`).

A request's parameters define the law of its output: `temperature`, `top_k` and `top_p` shape the top level's
distribution p' (tempered, then the k most likely tokens, then the fewest of those whose probability reaches
top_p), which a `model` top samples, a `rejection` top reproduces exactly and an `smc` top targets as p'^alpha.
Levels below the top keep their configured temperatures. `seed` fixes the request's random streams, so its output
depends on its seed and parameters only, not on the requests it shares a batch with.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field
from typing import Any

from hsmc.errors import RequestError

_MASK64 = (1 << 64) - 1


def derive_seed(seed: int, index: int) -> int:
    """A seed for the `index`-th stream under `seed` (splitmix64 of the pair): prompt i of a `generate` call, or
    sample j of a request with n > 1, gets an independent stream that the same (seed, index) reproduces."""
    x = (seed * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1  # 63 bits: a non-negative int64


@dataclass(frozen=True)
class SamplingParams:
    """Per-request settings; None takes the config's value (`generation.*`, the top level's temperature and N)."""

    max_tokens: int | None = None
    stop: tuple[str, ...] | None = None  # stop strings: the output ends at the first one (not in the text); () none
    seed: int | None = None  # None: a fresh random seed
    temperature: float | None = None  # 0 = greedy (not under an smc top, whose weights need p_T)
    top_p: float = 1.0  # keep the fewest most likely tokens whose probability reaches top_p (1 = all)
    top_k: int = 0  # keep the k most likely tokens (0 = all)
    particles: int | None = None  # smc top: N
    ignore_eos: bool = False  # decode max_tokens tokens whatever they are

    def __post_init__(self) -> None:
        """Type and range checks that need no config; each error names its field."""
        checks: list[tuple[str, Any, type | tuple[type, ...]]] = [
            ("max_tokens", self.max_tokens, int),
            ("seed", self.seed, int),
            ("temperature", self.temperature, (int, float)),
            ("top_p", self.top_p, (int, float)),
            ("top_k", self.top_k, int),
            ("particles", self.particles, int),
            ("ignore_eos", self.ignore_eos, bool),
        ]
        for name, value, kind in checks:
            wrong = not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool)
            if value is not None and wrong:
                raise RequestError(f"{name} must be of type {_kind(kind)}, got {value!r}", name)
        if self.stop is not None and (
            not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop)
        ):
            raise RequestError(f"stop must be a list of non-empty strings, got {self.stop!r}", "stop")
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise RequestError(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        if self.temperature is not None and not (0 <= self.temperature < math.inf):
            raise RequestError(f"temperature must be a finite number >= 0, got {self.temperature}", "temperature")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must lie in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < 0:
            raise RequestError(f"top_k must be >= 0 (0 keeps every token), got {self.top_k}", "top_k")
        if self.particles is not None and self.particles < 1:
            raise RequestError(f"particles must be at least 1, got {self.particles}", "particles")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise RequestError(f"seed must lie in [0, 2**63), got {self.seed}", "seed")

    @property
    def truncates(self) -> bool:
        return self.top_k > 0 or self.top_p < 1


def _kind(kind: type | tuple[type, ...]) -> str:
    return "number" if isinstance(kind, tuple) else {"int": "integer", "bool": "boolean"}[kind.__name__]


def fresh_seed() -> int:
    return secrets.randbits(63)


@dataclass
class Particle:
    token_ids: list[int]  # generated ids only
    text: str
    log_weight: float  # since the last resampling
    finish_reason: str


@dataclass
class SMCOutcome:
    """An smc top's whole particle system at the end of a request."""

    particles: list[Particle]  # all N, the returned one at index `chosen`
    chosen: int
    log_z: float  # log Ẑ: Σ over resampling intervals (the last included) of logsumexp(logw) − log N
    resamplings: int


@dataclass
class Result:
    text: str
    token_ids: list[int]  # generated ids only
    finish_reason: str  # "stop" or "length"
    # new_tokens, seconds (submission to last token), tokens_per_s, first_token_seconds; `generate` adds
    # "levels": the statistics of every level over its whole call
    stats: dict[str, Any]
    smc: SMCOutcome | None = None  # set when the top level is smc
    # this request's own statistics per level, bottom to top: rejection `mean_accepted_length`, smc
    # `mean_ess_fraction`, `resample_rate`, `log_z`
    levels: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Increment:
    """Part of one request's output that can no longer change (a `stream()` item)."""

    index: int  # the request: its prompt's index in a `generate` / `stream` call, else its id
    token_ids: list[int]  # tokens since the request's previous increment
    text: str  # text since the previous increment; all of them joined are a prefix of the final text
    result: Result | None = None  # set on the request's last increment
    generated: int = 0  # tokens generated so far (an smc top: by its longest particle), a progress signal
    levels: list[dict[str, Any]] = field(default_factory=list)  # the request's level statistics so far
    error: BaseException | None = None  # set (on the last increment) when the request failed or was cancelled
