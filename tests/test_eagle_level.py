"""`eagle3` level: lossless drafting under a rejection level, and particle-safe head state."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_CONFIGS, make_tiny_model
from helpers import assert_pools_empty
from test_eagle_checkpoint import published_layout
from test_rejection import _chi2_pvalue, _exact_first_tokens, _hf_greedy

from hsmc.decoder import HierarchicalDecoder

LLAMA = TINY_CONFIGS["llama"]
SIZES = (LLAMA["hidden_size"], LLAMA["num_attention_heads"], LLAMA["num_key_value_heads"], 16, 96)


@pytest.fixture(scope="module")
def verifier_and_head(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle")
    verifier = make_tiny_model("llama", root / "verifier", seed=2)
    head, _ = published_layout(root / "head", dtype=torch.float32, sizes=(*SIZES, 101, 40), scale=0.3)
    return verifier, head


def _stack(head, verifier, draft_t, target_t, gamma=3, top=None, rows=16):
    levels = [
        {"kind": "eagle3", "model": str(head), "temperature": draft_t},
        {"kind": "rejection", "model": str(verifier), "temperature": target_t, "num_draft_tokens": gamma},
    ]
    if top:
        levels.append(top)
    return HierarchicalDecoder.from_config(
        {"levels": levels, "engine": {"kv_capacity_tokens": 4096, "max_batch_rows": rows}}
    )


@pytest.mark.parametrize("draft_t", [0.0, 1.0])
@pytest.mark.parametrize(
    "prompts",
    [[[5, 9, 13], [7] * 11, [40, 41, 42, 43, 44, 45], [3, 4], [8]], [[3], [60]]],
    ids=["mixed-lengths", "one-token-prompts"],
)
def test_temperature_zero_equals_verifier_greedy(verifier_and_head, draft_t, prompts):
    """A one-token prompt has no (feature, token) pair yet: the head drafts uniformly until the first verify."""
    verifier, head = verifier_and_head
    decoder = _stack(head, verifier, draft_t, 0.0)
    results = decoder.generate(prompts, max_new_tokens=20, ignore_eos=True)
    for prompt, result in zip(prompts, results):
        assert result.token_ids == _hf_greedy(verifier, prompt, 20)
    assert_pools_empty(decoder)


def make_small_vocab_pair(root):
    """Verifier vocabulary 6, draft vocabulary 4: q is zero on two tokens the verifier can emit."""
    verifier = make_tiny_model("llama", root / "verifier", seed=4, vocab_size=6, eos_token_id=5)
    head, _ = published_layout(root / "head", dtype=torch.float32, sizes=(*SIZES, 6, 4), scale=0.5, seed=9)
    return verifier, head


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    return make_small_vocab_pair(tmp_path_factory.mktemp("eagle-small"))


@pytest.mark.parametrize("draft_t", [1.0, 0.0], ids=["sampled-drafts", "deterministic-drafts"])
def test_lossless_in_distribution(small_vocab, draft_t):
    verifier, head = small_vocab
    prompt, n_samples = [1, 4, 2], 20_000
    decoder = _stack(head, verifier, draft_t, 1.0, gamma=2, rows=2500)
    results = decoder.generate([prompt] * n_samples, max_new_tokens=3, ignore_eos=True, seed=13)
    assert _chi2_pvalue([tuple(r.token_ids) for r in results], _exact_first_tokens(verifier, prompt, 3)) > 1e-3
    assert results[0].stats["levels"][1]["mean_accepted_length"] > 1.2, "the head's drafts should be used"
    assert_pools_empty(decoder)


def test_forked_rows_keep_their_own_head_state(verifier_and_head):
    """Fork a row, make the copies diverge (as SMC resampling does), run on, and compare each row's
    head output with a fresh head that saw only that row's committed tokens. A head KV shared
    wrongly between rows, or not copied, changes these logits."""
    verifier, head = verifier_and_head
    decoder = _stack(head, verifier, 0.0, 0.0)
    eagle, rejection = decoder.stack.levels
    row0 = torch.tensor([0])
    rejection.load_prompts(row0, [[5, 9, 13, 17]])
    rejection.prefill(row0)
    for _ in range(5):
        rejection.propose(row0, 1)
        rejection.commit(row0, 1)
    rows = torch.tensor([0, 1, 2])
    rejection.fork(torch.tensor([0, 0]), torch.tensor([1, 2]))
    keep = rejection.acknowledged[rows] - 1
    rejection.accept(rows, keep, torch.tensor([30, 31, 32]))  # three different continuations
    for _ in range(6):
        rejection.propose(rows, 1)
        rejection.commit(rows, 1)
    _assert_head_matches_a_fresh_one(decoder, head, verifier, range(3))
    assert len({tuple(eagle.state.seq[r, :12].tolist()) for r in range(3)}) == 3


def _assert_head_matches_a_fresh_one(decoder, head, verifier, rows):
    """Each row's head output equals that of a fresh head that saw only the row's committed tokens."""
    eagle = decoder.stack.levels[0]
    fresh = _stack(head, verifier, 0.0, 0.0)
    f_eagle, f_rejection = fresh.stack.levels
    for r in rows:
        committed = eagle.state.seq[r, : int(eagle.state.seq_len[r])].tolist()
        one = torch.tensor([r])
        f_rejection.load_prompts(one, [committed])
        f_rejection.prefill(one)
        assert torch.allclose(eagle.last_logits[r], f_eagle.last_logits[r], atol=1e-4), f"row {r}"


def test_cut_ending_on_the_verifiers_pending_token_is_bridged_then_replaced(verifier_and_head):
    """A level above the verifier (smc, a rejection level) may keep every token the verifier emitted, the last
    of which the verifier has not processed (no feature yet), and append its own. The head bridges that pair
    with its own output; once the verifier's feature arrives, the head must hold exactly the pairs a fresh
    head builds from the committed tokens (a stale ring entry used as the feature would stay in its KV)."""
    verifier, head = verifier_and_head
    above = {"kind": "rejection", "model": str(verifier), "temperature": 0.0}  # whose accepts are played here
    decoder = _stack(head, verifier, 0.0, 0.0, top=above)
    rejection = decoder.stack.levels[1]
    rows = torch.tensor([0, 1])
    rejection.load_prompts(rows, [[5, 9, 13, 17], [3]])
    rejection.prefill(rows)
    for _ in range(3):
        rejection.propose(rows, 1)
        rejection.commit(rows, 1)
    everything = rejection.state.seq_len[rows]
    assert (rejection.state.kv_len[rows] == everything - 1).all(), "the last emitted token is still pending"
    rejection.accept(rows, everything, torch.tensor([30, 31]))
    for _ in range(4):
        rejection.propose(rows, 1)
        rejection.commit(rows, 1)
    _assert_head_matches_a_fresh_one(decoder, head, verifier, [0, 1])


def test_three_level_stack_with_resampling_leaks_nothing(verifier_and_head, tmp_path):
    verifier, head = verifier_and_head
    target = make_tiny_model("llama", tmp_path / "target", seed=3)
    smc = {
        "kind": "smc",
        "model": str(target),
        "temperature": 1.0,
        "particles": 4,
        "block_size": 3,
        "ess_threshold": 0.9,
    }
    decoder = _stack(head, verifier, 1.0, 1.0, top=smc)
    results = decoder.generate([[5, 9, 13], [7, 8]] * 3, max_new_tokens=12, seed=2)
    assert all(1 <= len(r.token_ids) <= 12 for r in results)
    assert results[0].stats["levels"][2]["resample_rate"] > 0
    assert_pools_empty(decoder)
