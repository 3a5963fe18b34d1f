"""`hsmc.cost_model` against step times worked out by hand, and `hsmc bench --config` on the CPU."""

from __future__ import annotations

import json

import pytest
from conftest import make_tiny_model

from hsmc.cli import main
from hsmc.cost_model import LevelCost, predict, roofline, with_accepted_length
from hsmc.decoder import HierarchicalDecoder
from hsmc.errors import ConfigError
from hsmc.levels.block_fill import geometric_yield_law, plan_rounds


def test_smc_over_a_model():
    """K = 8 proposal forwards of 8 ms and one 20 ms verify make a cycle of 84 ms and 9 tokens."""
    stack = [LevelCost("model", 8.0), LevelCost("smc", 20.0, block_size=8)]
    p = predict(stack)
    assert p.step_ms == pytest.approx(84.0) and p.tokens_per_step == 9
    assert p.tokens_per_s == pytest.approx(9 / 0.084)
    # the weight-read bound of the same cycle: 16.4 GB and 65.5 GB at 4.24 TB/s
    bound = roofline(stack, [16.4 / 4.24, 65.5 / 4.24])
    assert bound.step_ms == pytest.approx((8 * 16.4 + 65.5) / 4.24)
    assert bound.tokens_per_s == pytest.approx(9 / ((8 * 16.4 + 65.5) / 4240))


def test_hierarchical_block_fill_and_deferrals():
    """Measured: 6 rounds per block of 16, each 4 head steps (0.5 ms) and one 8 ms verify = 60 ms, plus the 20 ms
    target verify; a tenth of the cycles deferred: 17 * 0.9 tokens."""
    stack = [
        LevelCost("eagle3", 0.5),
        LevelCost("rejection", 8.0, gamma=4, accepted_length=3.5, fill_rounds=6),
        LevelCost("smc", 20.0, block_size=16, particles=6, deferral_rate=0.1),
    ]
    p = predict(stack)
    assert p.step_ms == pytest.approx(80.0) and p.tokens_per_step == pytest.approx(15.3)
    # a perfect drafter (accepted length γ + 1 = 5): ceil(16 / 5) = 4 rounds never defer
    perfect = predict(with_accepted_length(stack, 5.0))
    assert perfect.step_ms == pytest.approx(4 * 10 + 20) and perfect.tokens_per_step == pytest.approx(17)
    # at 3.5 tokens per round: the rounds and deferrals the block fill plans for 6 particles, the 20 ms verify
    # costing 2 rounds of 10 ms
    rounds, deferred = plan_rounds(16, geometric_yield_law(3.5, 4), 6, 2.0)
    stated = predict(with_accepted_length(stack, 3.5))
    assert stated.step_ms == pytest.approx(rounds * 10 + 20)
    assert stated.tokens_per_step == pytest.approx(17 * (1 - deferred))
    assert rounds == 7 and 0.05 < deferred < 0.2
    # a graphed cycle's time holds its rounds: nothing to plan a fill from
    graphed = [*stack[:2], LevelCost("smc", 80.0, block_size=16, particles=6, cycle_includes_proposal=True)]
    with pytest.raises(ValueError, match="graphed cycle"):
        predict(with_accepted_length(graphed, 3.5))


def test_a_graphed_round_is_timed_whole():
    """A graphed round's 10 ms already holds its head steps: 6 rounds of 10 ms + the 20 ms verify, not 6 x 12 +
    20; its weight-read bound still counts every forward (4 head reads of 0.2 ms + the 8B's 4 ms per round)."""
    stack = [
        LevelCost("eagle3", 0.5),
        LevelCost("rejection", 10.0, gamma=4, accepted_length=3.5, fill_rounds=6, round_includes_drafts=True),
        LevelCost("smc", 20.0, block_size=16, deferral_rate=0.0),
    ]
    assert predict(stack).step_ms == pytest.approx(6 * 10 + 20)
    assert roofline(stack, [0.2, 4.0, 15.0]).step_ms == pytest.approx(6 * (4 * 0.2 + 4.0) + 15.0)
    streaming = [LevelCost("eagle3", 0.5), LevelCost("rejection", 7.0, gamma=4, round_includes_drafts=True)]
    assert predict(streaming).step_ms == pytest.approx(7.0)


def test_a_graphed_cycle_is_timed_whole():
    """A graphed SMC cycle's 60 ms holds its K = 8 proposal steps: the cycle is 60 ms, not 8 x 5 + 60; its
    bound still counts every forward, and a deferred cycle still emits nothing."""
    stack = [LevelCost("model", 5.0), LevelCost("smc", 60.0, block_size=8, cycle_includes_proposal=True)]
    assert predict(stack).step_ms == pytest.approx(60.0) and predict(stack).tokens_per_step == 9
    assert roofline(stack, [3.9, 15.4]).step_ms == pytest.approx(8 * 3.9 + 15.4)
    deferred = [stack[0], LevelCost("smc", 60.0, block_size=8, deferral_rate=0.25, cycle_includes_proposal=True)]
    assert predict(deferred).tokens_per_step == pytest.approx(9 * 0.75)


def test_rejection_tops_and_rejection_under_rejection():
    """[model 1 ms, rejection 4 ms (γ = 2), rejection 10 ms (γ = 3, 3 tokens per cycle)]: the lower level runs
    ceil(3 / 3) = 1 cycle of 2 drafts + its verify (6 ms) per top cycle of 16 ms and 3 tokens."""
    stack = [
        LevelCost("model", 1.0),
        LevelCost("rejection", 4.0, gamma=2, accepted_length=2.5),
        LevelCost("rejection", 10.0, gamma=3, accepted_length=3.0),
    ]
    p = predict(stack)
    assert p.step_ms == pytest.approx(16.0) and p.tokens_per_s == pytest.approx(187.5)
    assert predict([LevelCost("model", 5.0)]).tokens_per_s == pytest.approx(200.0)


def test_unknown_random_shape_is_a_clear_error():
    with pytest.raises(ConfigError, match="unknown shape 'qwen9'.*qwen3-8b"):
        HierarchicalDecoder.from_config({"levels": [{"model": "random:qwen9"}]})


def test_bench_config_on_the_cpu(tmp_path, capsys):
    """Rows for every number of requests, with the step against its bound, the cost model's prediction (also
    at a stated accepted length, the stack having a rejection level) and every level's statistics."""
    draft = make_tiny_model("llama", tmp_path / "draft", seed=1)
    target = make_tiny_model("llama", tmp_path / "target", seed=2)
    config = tmp_path / "stack.yaml"
    config.write_text(
        f"levels:\n  - {{kind: model, model: {draft}, temperature: 1.0}}\n"
        f"  - {{kind: rejection, model: {draft}, temperature: 1.0, num_draft_tokens: 2}}\n"
        f"  - {{kind: smc, model: {target}, temperature: 1.0, particles: 2, block_size: 3}}\n"
    )
    args = ["bench", "--config", str(config), "--batch", "1,3", "--prompt-tokens", "4", "--new-tokens", "48"]
    assert main([*args, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["batch"] for r in rows] == [1, 3] and all(r["name"] == "stack" for r in rows)
    for r in rows:
        assert r["tok_s_total"] == pytest.approx(r["batch"] * r["tok_s_request"])
        assert (
            r["step_ms"] > 0
            and r["bound_step_ms"] > 0
            and r["of_bound"] == pytest.approx(r["step_ms"] / r["bound_step_ms"])
        )
        assert r["predicted_tok_s_request"] > 0 and set(r["predicted_at"]) == {"3.5"}
        assert [lv["kind"] for lv in r["levels"]] == ["model", "rejection", "smc"]
        assert all(0 <= lv["share_of_time"] <= 1 and lv["forward_ms"] > 0 for lv in r["levels"])
        rejection, smc = r["levels"][1:]
        # the drafter is the verifier: every draft is accepted, γ + 1 tokens per round
        assert rejection["mean_accepted_length"] == pytest.approx(3.0) and rejection["mean_fill_rounds"] >= 1
        assert {"mean_ess_fraction", "resample_rate", "deferred_step_rate"} <= set(smc)
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "bound ms" in table and "deferred" in table and "fill rounds" in table
    # decode speed is the N-token run minus the 1-token run: one new token measures nothing
    assert main([*args[:-1], "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--new-tokens=1" in err[0]
