"""A rejection level under smc fills each SMC block in a fixed number of rounds; a group whose block is still
short is deferred to the next cycle. Deferral must leave the output distribution exactly as it was."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from conftest import make_tiny_model
from helpers import assert_pools_empty
from test_smc_level import VOCAB, _exact_target, _sampling_floor, _tv

from hsmc.decoder import HierarchicalDecoder

PROMPT, NEW_TOKENS = [1, 2, 0], 4  # x0, then one cycle of K = 2 drafts + the bonus


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("fill")
    return {
        name: make_tiny_model("llama", root / name, seed=seed, vocab_size=VOCAB, eos_token_id=3)
        for name, seed in (("draft", 7), ("mid", 9), ("target", 8))
    }


def _run(models, mid: str, particles: int, samples: int, margin: int, seed: int):
    """[model draft, rejection `mid` (γ = 1), smc target (K = 2)]; `margin` sets the fill rounds (≤ -2: one
    round of at most 2 tokens per block, so a block is often short and its group deferred)."""
    levels = [
        {"kind": "model", "model": str(models["draft"]), "temperature": 1.0},
        {"kind": "rejection", "model": str(models[mid]), "temperature": 1.0, "num_draft_tokens": 1},
        {"kind": "smc", "model": str(models["target"]), "temperature": 1.0, "particles": particles, "block_size": 2},
    ]
    decoder = HierarchicalDecoder.from_config(
        {"levels": levels, "engine": {"kv_capacity_tokens": 16384, "max_batch_rows": 2048}}
    )
    decoder.stack.levels[1].fill.margin = margin
    results = decoder.generate([PROMPT] * samples, max_new_tokens=NEW_TOKENS, ignore_eos=True, seed=seed)
    assert_pools_empty(decoder)
    rejection, smc = results[0].stats["levels"][1:]
    return results, rejection["mean_fill_rounds"], smc["deferred_step_rate"]


def test_deferred_steps_keep_the_output_exact(models):
    """The mid model equal to the target makes every weight 0, so the output is exactly the target's for any
    N: a deferral that lost, repeated or misplaced a token would show as TV far above the sampling floor."""
    exact = _exact_target(models["target"], PROMPT, NEW_TOKENS, 1.0)
    samples = 3000
    floor = _sampling_floor(exact, samples)
    results, rounds, deferred = _run(models, "target", particles=2, samples=samples, margin=-2, seed=1)
    tv = _tv(results, exact)
    print(f"deferral, exact proposal: TV {tv:.3f}, floor {floor:.3f}, rounds {rounds:.2f}, deferred {deferred:.2f}")
    assert rounds == 1 and deferred > 0.2
    assert tv < 1.5 * floor


def test_deferral_changes_nothing_under_real_weights(models):
    """With a mid model unlike the target the weights do the work, and at N = 4 the output is still biased
    away from p_T; deferring steps must not change that law. The outputs with frequent deferrals and with
    (almost) none differ only by sampling noise: their TV is at the two-sample floor (√2 × one sample's)."""
    exact = _exact_target(models["target"], PROMPT, NEW_TOKENS, 1.0)
    samples = 3000
    floor = math.sqrt(2) * _sampling_floor(exact, samples)
    deferred_results, _, deferred = _run(models, "mid", particles=4, samples=samples, margin=-2, seed=1)
    plain_results, rounds, plain = _run(models, "mid", particles=4, samples=samples, margin=1, seed=2)
    a, b = _frequencies(deferred_results), _frequencies(plain_results)
    between = 0.5 * sum(abs(a.get(s, 0.0) - b.get(s, 0.0)) for s in a.keys() | b.keys())
    print(f"deferral, mid proposal: TV between {between:.3f} (two-sample floor {floor:.3f}); deferred {deferred:.2f}")
    print(f"to p_T: {_tv(deferred_results, exact):.3f} and {_tv(plain_results, exact):.3f}; plain rounds {rounds:.2f}")
    assert deferred > 0.2 and plain < deferred / 4
    assert between < 1.5 * floor


def _frequencies(results) -> dict[tuple[int, ...], float]:
    counts = Counter(tuple(r.token_ids) for r in results)
    return {s: c / len(results) for s, c in counts.items()}
