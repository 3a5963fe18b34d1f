"""Tree drafting in a `rejection` level: a greedy verifier gets its own greedy decode, a sampled one its exact
distribution (χ² of the first 3 tokens), and the KV keeps only the accepted paths."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model
from helpers import assert_pools_empty
from test_rejection import VOCAB, _chi2_pvalue, _exact_first_tokens, _hf_greedy

from hsmc.decoder import HierarchicalDecoder


def _tree_stack(draft, target, draft_t, target_t, rule, depth=4, topk=2, budget=8, draft_layers=None, **engine):
    return HierarchicalDecoder.from_config(
        {
            "levels": [
                {"kind": "model", "model": str(draft), "temperature": draft_t, "num_layers": draft_layers},
                {
                    "kind": "rejection",
                    "model": str(target),
                    "temperature": target_t,
                    "tree": {"depth": depth, "topk": topk, "budget": budget},
                    "tree_rule": rule,
                },
            ],
            "engine": {"kv_capacity_tokens": 4096, **engine},
        }
    )


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("tree") / "target", seed=2)


@pytest.mark.parametrize("rule,draft_t", [("target_only", 0.0), ("draft_aware", 1.0)])
def test_tree_at_temperature_zero_equals_verifier_greedy(target, rule, draft_t):
    decoder = _tree_stack(target, target, draft_t, 0.0, rule, depth=4, topk=2, budget=8, draft_layers=3)
    prompts = [[5, 9, 13], [7] * 11, [40, 41, 42, 43, 44, 45], [3]]
    results = decoder.generate(prompts, max_new_tokens=24, ignore_eos=True)
    for prompt, result in zip(prompts, results):
        assert result.token_ids == _hf_greedy(target, prompt, 24)
    accepted = results[0].stats["levels"][1]["mean_accepted_length"]
    assert 1.0 < accepted < 5.0, "drafts should be partly accepted"
    assert_pools_empty(decoder)
