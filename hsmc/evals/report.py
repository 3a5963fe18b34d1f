"""Summaries of eval records: a row per config, paired comparisons to the first config, a plot."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hsmc.errors import HsmcError
from hsmc.evals.stats import mcnemar_exact, wilson_interval

SIGNIFICANCE = 0.05


@dataclass
class ConfigSummary:
    label: str
    config: str
    n: int
    correct: int
    accuracy: float
    ci_low: float  # 95% Wilson interval
    ci_high: float
    tokens: int
    generate_seconds: float
    tokens_per_s: float
    mean_accepted_length: float | None  # the top rejection level's, token-weighted over chunks
    ess_fraction: float | None  # the smc level's mean ESS / N
    resample_rate: float | None  # the smc level's resamples per cycle
    difference: float | None = None  # accuracy minus the first config's, on paired items
    only_first: int | None = None  # items only the first config got right
    only_this: int | None = None  # items only this config got right
    p_value: float | None = None  # exact McNemar against the first config
    within_noise: bool | None = None  # p_value >= SIGNIFICANCE
    same_answers: float | None = None  # share of paired items whose extracted answers equal the first config's


def summarize(label: str, config: str, records: list[dict[str, Any]]) -> ConfigSummary:
    n = len(records)
    correct = sum(bool(r["correct"]) for r in records)
    low, high = wilson_interval(correct, n)
    chunks: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        if "chunk" in r:  # samples scored from a file have no generation stats
            chunks.setdefault(r["chunk"], []).append(r)
    tokens = sum(r.get("tokens", 0) for r in records)
    seconds = sum(max(r["chunk_seconds"] for r in rs) for rs in chunks.values())
    return ConfigSummary(
        label=label,
        config=config,
        n=n,
        correct=correct,
        accuracy=correct / n if n else 0.0,
        ci_low=low,
        ci_high=high,
        tokens=tokens,
        generate_seconds=seconds,
        tokens_per_s=tokens / seconds if seconds > 0 else 0.0,
        mean_accepted_length=_level_metric(chunks, "rejection", "mean_accepted_length"),
        ess_fraction=_level_metric(chunks, "smc", "mean_ess_fraction"),
        resample_rate=_level_metric(chunks, "smc", "resample_rate"),
    )


def _level_metric(chunks: dict[int, list[dict[str, Any]]], kind: str, key: str) -> float | None:
    """Token-weighted mean over chunks of `key` of the topmost level of `kind` (None without such a level)."""
    total = weight = 0.0
    for rs in chunks.values():
        levels = [lv for lv in rs[0]["levels"] if lv["kind"] == kind and key in lv]
        if levels:
            w = sum(r["tokens"] for r in rs)
            total += w * levels[-1][key]
            weight += w
    return total / weight if weight else None


def compare(summaries: list[ConfigSummary], records: list[list[dict[str, Any]]]) -> None:
    """Fill in each later config's paired comparison to the first (items matched by id)."""
    first = {r["id"]: r for r in records[0]}
    for summary, rs in zip(summaries[1:], records[1:]):
        paired = [(first[r["id"]], r) for r in rs if r["id"] in first]
        test = mcnemar_exact([bool(a["correct"]) for a, _ in paired], [bool(b["correct"]) for _, b in paired])
        summary.same_answers = (
            sum(a["extracted"] == b["extracted"] for a, b in paired) / len(paired) if paired else None
        )
        summary.difference = test.difference
        summary.only_first, summary.only_this = test.only_first, test.only_other
        summary.p_value = test.p_value
        summary.within_noise = test.p_value >= SIGNIFICANCE


def format_table(summaries: list[ConfigSummary]) -> str:
    """A markdown table, then one sentence per paired comparison."""

    def opt(value: float | None, fmt: str) -> str:
        return "" if value is None else format(value, fmt)

    lines = [
        "| config | n | accuracy | 95% CI | tok/s | mean accepted | ESS/N | resample rate | Δ vs first | McNemar p "
        "| same answers |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        lines.append(
            f"| {s.label} | {s.n} | {s.accuracy:.3f} ({s.correct}/{s.n}) | [{s.ci_low:.3f}, {s.ci_high:.3f}] "
            f"| {s.tokens_per_s:.1f} | {opt(s.mean_accepted_length, '.2f')} | {opt(s.ess_fraction, '.2f')} "
            f"| {opt(s.resample_rate, '.2f')} | {opt(s.difference, '+.3f')} | {opt(s.p_value, '.3g')} "
            f"| {opt(s.same_answers, '.0%')} |"
        )
    first = summaries[0].label
    for s in summaries[1:]:
        verdict = "within noise" if s.within_noise else "a significant difference"
        lines.append(
            f"\n{s.label} vs {first}: {s.difference:+.3f} ({s.only_this} items right only here, {s.only_first} only "
            f"in {first}); exact McNemar p = {s.p_value:.3g}: {verdict} at the {SIGNIFICANCE:g} level."
        )
    return "\n".join(lines)


def summaries_json(task: str, summaries: list[ConfigSummary], extra: dict[str, Any]) -> dict[str, Any]:
    return {"task": task, **extra, "configs": [asdict(s) for s in summaries]}


def plot(summaries: list[ConfigSummary], task: str, path: Path) -> Path:
    """Accuracy (with its Wilson interval) against tokens per second, one point per config."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise HsmcError("--plot needs matplotlib: pip install 'hsmc[plot]'") from None
    fig, ax = plt.subplots(figsize=(6, 4))
    for s in summaries:
        err = [[s.accuracy - s.ci_low], [s.ci_high - s.accuracy]]
        ax.errorbar([s.tokens_per_s], [s.accuracy], yerr=err, fmt="o", capsize=4, label=s.label)
    ax.set_xlabel("tokens / s")
    ax.set_ylabel("accuracy (95% Wilson interval)")
    ax.set_title(f"{task}: accuracy vs speed")
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
