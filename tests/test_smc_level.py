"""`smc` level: the invariants of DESIGN.md §3 and convergence to p_T^alpha as N grows."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from conftest import make_tiny_model
from helpers import assert_pools_empty

from hsmc.decoder import HierarchicalDecoder
from hsmc.stopping import StopCriteria

VOCAB = 4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("smc")
    return (
        make_tiny_model("llama", root / "draft", seed=7, vocab_size=VOCAB, eos_token_id=3),
        make_tiny_model("llama", root / "target", seed=8, vocab_size=VOCAB, eos_token_id=3),
    )


def _smc(draft, target, draft_t=1.0, rows=64, **smc):
    return HierarchicalDecoder.from_config(
        {
            "levels": [
                {"kind": "model", "model": str(draft), "temperature": draft_t},
                {"kind": "smc", "model": str(target), "temperature": 1.0, **smc},
            ],
            "engine": {"kv_capacity_tokens": 8192, "max_batch_rows": rows},
        }
    )


def test_proposal_equal_to_target_gives_zero_weights(models):
    _, target = models
    decoder = _smc(target, target, particles=4, block_size=3, alpha=1.0)
    groups = decoder.stack.top.run([[1, 2, 0]] * 3, 10, StopCriteria(frozenset()))
    for g in groups:
        # zero up to fp32 rounding: the proposal scores one token per forward, the target K+1
        assert max(abs(w) for w in g.log_weights) < 1e-4
    assert decoder.stack.top.stats()["resample_rate"] == 0.0
    assert_pools_empty(decoder)


def test_block_size_zero_is_target_sampling(models):
    """K = 0, N = 1 draws the same tokens from the same seed as sampling the target alone."""
    draft, target = models
    smc = _smc(draft, target, particles=1, block_size=0)
    alone = HierarchicalDecoder.from_config({"levels": [{"model": str(target), "temperature": 1.0}]})
    prompts = [[1, 2, 0], [2, 2]]
    a = smc.generate(prompts, max_new_tokens=12, ignore_eos=True, seed=5)
    b = alone.generate(prompts, max_new_tokens=12, ignore_eos=True, seed=5)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]


def test_one_particle_returns_proposal_tokens_plus_target_bonus_tokens(models):
    """Near-zero temperatures make both draws argmaxes, so the output can be recomputed."""
    from transformers import AutoModelForCausalLM

    draft, target = models
    k = 3
    decoder = HierarchicalDecoder.from_config(
        {
            "levels": [
                {"kind": "model", "model": str(draft), "temperature": 1e-4},
                {"kind": "smc", "model": str(target), "temperature": 1e-4, "particles": 1, "block_size": k},
            ]
        }
    )
    prompt = [1, 2, 0]
    out = decoder.generate([prompt], max_new_tokens=1 + 2 * (k + 1), ignore_eos=True)[0].token_ids
    hf = {p: AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval() for p in (draft, target)}
    with torch.no_grad():
        argmax = {p: m(torch.tensor([prompt + out])).logits[0].argmax(-1).tolist() for p, m in hf.items()}
    for j, tok in enumerate(out):
        source = target if j % (k + 1) == 0 else draft  # x0, then K drafts and one bonus per cycle
        assert tok == argmax[source][len(prompt) + j - 1], f"token {j}"


def _exact_target(target, prompt, n, alpha, temperature=1.0):
    """Normalised p_T^alpha over all length-n continuations."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    seqs = list(itertools.product(range(VOCAB), repeat=n))
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([prompt + list(s) for s in seqs])).logits.double() / temperature, -1)
    score = [alpha * sum(logp[r, len(prompt) - 1 + j, t].item() for j, t in enumerate(s)) for r, s in enumerate(seqs)]
    z = max(score) + math.log(sum(math.exp(x - max(score)) for x in score))
    return {s: math.exp(x - z) for s, x in zip(seqs, score)}


@pytest.mark.parametrize("alpha", [1.0, 2.0])
def test_total_variation_to_exact_target_falls_with_particles(models, alpha):
    draft, target = models
    prompt, n_tokens, samples = [1, 2, 0], 3, 6000  # x0, then one cycle of K=1 draft + bonus
    exact = _exact_target(target, prompt, n_tokens, alpha)
    tv = []
    for n in (1, 4, 16):
        decoder = _smc(draft, target, rows=4096, particles=n, block_size=1, alpha=alpha, ess_threshold=0.5)
        results = decoder.generate([prompt] * samples, max_new_tokens=n_tokens, ignore_eos=True, seed=n)
        counts: dict[tuple[int, ...], int] = {}
        for r in results:
            counts[tuple(r.token_ids)] = counts.get(tuple(r.token_ids), 0) + 1
        tv.append(0.5 * sum(abs(counts.get(s, 0) / samples - p) for s, p in exact.items()))
        assert_pools_empty(decoder)
    print(f"alpha={alpha}: TV for N = 1, 4, 16: {tv}")
    assert tv[0] > tv[1] > tv[2], f"TV for N = 1, 4, 16: {tv}"


def test_resampling_happens_and_pools_return_to_empty(models):
    draft, target = models
    decoder = _smc(draft, target, draft_t=1.5, particles=8, block_size=3, ess_threshold=0.9)
    results = decoder.generate([[1, 2, 0], [0, 1], [2]] * 4, max_new_tokens=5, seed=1)
    smc_stats = results[0].stats["levels"][1]
    assert smc_stats["resample_rate"] > 0.1
    assert all(1 <= len(r.token_ids) <= 5 for r in results)
    assert any(r.finish_reason == "stop" for r in results) and any(r.finish_reason == "length" for r in results)
    assert_pools_empty(decoder)
