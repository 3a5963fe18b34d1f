"""Report statistics against first-principles formulas, record files across interruptions, tables and plots."""

from __future__ import annotations

import json
import math

import pytest

from hsmc.errors import HsmcError
from hsmc.evals.records import RecordFile
from hsmc.evals.report import compare, format_table, plot, summarize
from hsmc.evals.stats import mcnemar_exact, wilson_interval


@pytest.mark.parametrize("k,n", [(0, 10), (3, 10), (10, 10), (37, 100), (660, 1319)])
def test_wilson_interval_matches_the_formula(k, n):
    z = 1.959963984540054
    p = k / n
    center = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    low, high = wilson_interval(k, n)
    assert low == pytest.approx(center - half, abs=1e-9) and high == pytest.approx(center + half, abs=1e-9)


@pytest.mark.parametrize("b,c", [(0, 0), (1, 0), (5, 1), (3, 9), (12, 12)])
def test_mcnemar_exact_is_the_two_sided_binomial_tail_of_the_discordant_pairs(b, c):
    n = b + c
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2**n if n else 0.5
    expected = min(1.0, 2 * tail)
    first = [True] * b + [False] * c + [True] * 7 + [False] * 4
    other = [False] * b + [True] * c + [True] * 7 + [False] * 4
    test = mcnemar_exact(first, other)
    assert (test.only_first, test.only_other, test.n) == (b, c, n + 11)
    assert test.p_value == pytest.approx(expected, rel=1e-12)
    assert test.difference == pytest.approx((c - b) / (n + 11))


def _records(correct: list[bool], tokens: int = 10, chunk_seconds: float = 2.0) -> list[dict]:
    levels = [
        {"kind": "model", "model": "d", "share_of_time": 0.1},
        {"kind": "rejection", "model": "t", "share_of_time": 0.5, "mean_accepted_length": 2.0},
        {"kind": "smc", "model": "t", "share_of_time": 0.4, "mean_ess_fraction": 0.5, "resample_rate": 0.25},
    ]
    return [
        {"id": f"q{i}", "correct": c, "extracted": str(int(c)), "tokens": tokens, "chunk": i // 2,
         "chunk_seconds": chunk_seconds, "levels": levels}
        for i, c in enumerate(correct)
    ]  # fmt: skip


def test_summary_and_paired_comparison_table():
    first = _records([True, True, False, False, True, False])
    other = _records([True, False, False, False, False, False], tokens=20)
    summaries = [summarize("base", "a.yaml", first), summarize("fast", "b.yaml", other)]
    compare(summaries, [first, other])
    base, fast = summaries
    assert (base.n, base.correct, base.accuracy) == (6, 3, 0.5)
    assert base.tokens_per_s == pytest.approx(60 / 6.0)  # 3 chunks of 2 s
    assert fast.tokens_per_s == pytest.approx(120 / 6.0)
    assert (base.mean_accepted_length, base.ess_fraction, base.resample_rate) == (2.0, 0.5, 0.25)
    assert (fast.only_first, fast.only_this, fast.difference) == (2, 0, pytest.approx(-2 / 6))
    assert fast.p_value == pytest.approx(0.5) and fast.within_noise
    assert fast.same_answers == pytest.approx(4 / 6) and base.same_answers is None
    table = format_table(summaries)
    assert "| fast | 6 | 0.167 (1/6) |" in table and table.splitlines()[3].endswith("| 67% |")
    assert (
        "fast vs base: -0.333 (0 items right only here, 2 only in base); exact McNemar p = 0.5: within noise" in table
    )


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    summaries = [summarize("base", "a.yaml", _records([True, False]))]
    path = plot(summaries, "gsm8k", tmp_path / "p.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_record_file_resumes_drops_a_torn_line_and_refuses_other_settings(tmp_path):
    path = tmp_path / "r.jsonl"
    records = RecordFile(path, {"config": "a", "n": 1})
    records.append([{"id": "x", "correct": True}, {"id": "y", "correct": False}])
    with path.open("a") as f:
        f.write('{"id": "z", "corr')
    again = RecordFile(path, {"config": "a", "n": 1})
    assert list(again.records) == ["x", "y"]
    assert path.read_text().endswith('"correct": false}\n')  # the torn tail is gone
    again.append([{"id": "z", "correct": True}])
    assert [json.loads(line).get("id") for line in path.read_text().splitlines()] == [None, "x", "y", "z"]
    with pytest.raises(HsmcError, match=r"r.jsonl was written by a run with other settings \(differs in n\)"):
        RecordFile(path, {"config": "a", "n": 2})
