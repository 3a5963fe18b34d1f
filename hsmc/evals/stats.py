"""The statistics behind "within noise": Wilson intervals and the exact McNemar test (through scipy)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hsmc.errors import HsmcError


def _binomtest(k: int, n: int):
    try:
        from scipy.stats import binomtest
    except ImportError:
        raise HsmcError("hsmc eval needs scipy for its intervals and tests: pip install 'hsmc[eval]'") from None
    return binomtest(k, n, 0.5)


def wilson_interval(correct: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Wilson score interval of a proportion; (0, 1) when there is no sample."""
    if n == 0:
        return 0.0, 1.0
    ci = _binomtest(correct, n).proportion_ci(confidence_level=confidence, method="wilson")
    return float(ci.low), float(ci.high)


@dataclass
class PairedTest:
    n: int  # items scored under both configs
    only_first: int  # correct under the first config only
    only_other: int  # correct under the other config only
    p_value: float  # exact McNemar: two-sided binomial test of the discordant pairs

    @property
    def difference(self) -> float:
        """Accuracy of the other config minus that of the first, on the paired items."""
        return (self.only_other - self.only_first) / self.n if self.n else 0.0


def mcnemar_exact(first: Sequence[bool], other: Sequence[bool]) -> PairedTest:
    """Paired comparison of two configs' per-item correctness (same items, same order)."""
    if len(first) != len(other):
        raise ValueError(f"paired samples differ in length: {len(first)} vs {len(other)}")
    only_first = sum(a and not b for a, b in zip(first, other))
    only_other = sum(b and not a for a, b in zip(first, other))
    discordant = only_first + only_other
    p_value = float(_binomtest(only_first, discordant).pvalue) if discordant else 1.0
    return PairedTest(len(first), only_first, only_other, p_value)
