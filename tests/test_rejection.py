"""`rejection` level: greedy equality with the verifier, and losslessness in distribution."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import make_tiny_model
from helpers import assert_greedy_as_target_with_partial_acceptance, assert_pools_empty
from scipy.stats import chisquare

from hsmc.decoder import HierarchicalDecoder

VOCAB = 6


def _stack(draft, target, draft_t, target_t, gamma=3, draft_layers=None, **engine):
    return HierarchicalDecoder.from_config(
        {
            "levels": [
                {"kind": "model", "model": str(draft), "temperature": draft_t, "num_layers": draft_layers},
                {"kind": "rejection", "model": str(target), "temperature": target_t, "num_draft_tokens": gamma},
            ],
            "engine": {"kv_capacity_tokens": 4096, **engine},
        }
    )


@torch.no_grad()
def _hf_greedy(path, prompt, n, ignore_eos=True):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    at_least = n if ignore_eos else 0
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=at_least, do_sample=False)
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """Two different random models sharing a vocabulary: drafts are often, not always, right."""
    root = tmp_path_factory.mktemp("pair")
    return make_tiny_model("llama", root / "draft", seed=1), make_tiny_model("llama", root / "target", seed=2)


@pytest.mark.parametrize("draft_t", [0.0, 1.0])
def test_temperature_zero_equals_verifier_greedy(pair, draft_t):
    _, target = pair
    decoder = _stack(target, target, draft_t, 0.0, gamma=4, draft_layers=3)  # a layer-truncated self-draft
    assert_greedy_as_target_with_partial_acceptance(decoder, target, _hf_greedy)


def test_self_draft_is_always_accepted(pair):
    _, target = pair
    decoder = _stack(target, target, 0.0, 0.0, gamma=3)
    result = decoder.generate([[5, 9, 13]], max_new_tokens=16, ignore_eos=True)[0]
    assert result.token_ids == _hf_greedy(target, [5, 9, 13], 16)
    assert result.stats["levels"][1]["mean_accepted_length"] == pytest.approx(4.0)


@pytest.mark.slow
def test_smollm2_truncated_draft_greedy_equals_full_model(smollm2_dir):
    from test_generation import CHAT_PROMPTS

    from hsmc.models.tokenizer import encode_prompt

    decoder = HierarchicalDecoder.from_config(
        {
            "levels": [
                {"kind": "model", "model": str(smollm2_dir), "num_layers": 12},
                {"kind": "rejection", "model": str(smollm2_dir), "num_draft_tokens": 4},
            ],
            "engine": {"kv_capacity_tokens": 2048},
        }
    )
    results = decoder.generate(CHAT_PROMPTS, max_new_tokens=32)
    for prompt, result in zip(CHAT_PROMPTS, results):
        ids = encode_prompt(decoder.tokenizer, prompt, chat_template=True)
        assert result.token_ids == _hf_greedy(smollm2_dir, ids, 32, ignore_eos=False)
    assert_pools_empty(decoder)


def _exact_first_tokens(path, prompt, n, temperature=1.0) -> dict[tuple[int, ...], float]:
    """Exact probability of every length-n continuation under the model at `temperature`."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    seqs = list(itertools.product(range(VOCAB), repeat=n))
    ids = torch.tensor([prompt + list(s) for s in seqs])
    with torch.no_grad():
        logp = torch.log_softmax(hf(ids).logits.double() / temperature, -1)
    probs = {}
    for row, s in enumerate(seqs):
        probs[s] = sum(logp[row, len(prompt) - 1 + j, t].item() for j, t in enumerate(s))
    return {s: float(torch.tensor(v).exp()) for s, v in probs.items()}


def _chi2_pvalue(samples: list[tuple[int, ...]], exact: dict[tuple[int, ...], float]) -> float:
    """Chi-square on cells pooled so that every expected count is >= 5."""
    n = len(samples)
    counts = {s: 0 for s in exact}
    for s in samples:
        counts[s] += 1
    big = [s for s in exact if exact[s] * n >= 5]
    small = [s for s in exact if exact[s] * n < 5]
    observed = [counts[s] for s in big] + [sum(counts[s] for s in small)]
    expected = [exact[s] for s in big] + [sum(exact[s] for s in small)]
    return chisquare(observed, [e * n / sum(expected) for e in expected]).pvalue


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("small")
    return (
        make_tiny_model("llama", root / "draft", seed=3, vocab_size=VOCAB, eos_token_id=5),
        make_tiny_model("llama", root / "target", seed=4, vocab_size=VOCAB, eos_token_id=5),
    )


@pytest.mark.parametrize("draft_t", [0.7, 0.0], ids=["sampled-drafts", "deterministic-drafts"])
def test_lossless_in_distribution(small_vocab_pair, draft_t):
    draft, target = small_vocab_pair
    prompt, n_samples = [1, 4, 2], 20_000
    decoder = _stack(draft, target, draft_t, 1.0, gamma=2, max_batch_rows=2500)
    results = decoder.generate([prompt] * n_samples, max_new_tokens=3, ignore_eos=True, seed=11)
    samples = [tuple(r.token_ids) for r in results]
    exact = _exact_first_tokens(target, prompt, 3)
    assert _chi2_pvalue(samples, exact) > 1e-3
    # the test has power: the drafter's own distribution is told apart from the target's
    assert _chi2_pvalue(samples, _exact_first_tokens(draft, prompt, 3, max(draft_t, 1.0))) < 1e-6
    assert_pools_empty(decoder)


def test_feature_reading_drafter_receives_the_verifiers_residual_streams(pair):
    """The hook an EAGLE3 drafter uses: after the prompt and after every verify, the drafter gets
    the verifier's captured streams; the committed positions must equal transformers' hidden_states."""
    from helpers import make_state
    from transformers import AutoModelForCausalLM

    from hsmc.engine.random_streams import RowStreams
    from hsmc.engine.sampler import RowLaws
    from hsmc.levels.model import ModelLevel
    from hsmc.levels.rejection import RejectionLevel
    from hsmc.models.loading import load_model

    draft_path, target_path = pair
    layers = (1, 3)

    class RecordingDrafter(ModelLevel):
        feature_layers = layers

        def __init__(self, *args):
            super().__init__(*args)
            self.seen: dict[tuple[int, int], torch.Tensor] = {}

        def _record(self, rows, upto, features):
            for r, row in enumerate(rows.tolist()):
                for j in range(int(features.count[r])):
                    position = int(features.start[r]) + j
                    if position < int(upto[r]):
                        self.seen[(row, position)] = features.features[r, j]

        def prefill(self, rows, features=None):
            self._record(rows, self.state.seq_len[rows] - 1, features)
            super().prefill(rows)

        def accept(self, rows, keep_len, next_token, features=None):
            if features is not None:
                self._record(rows, keep_len, features)
            super().accept(rows, keep_len, next_token)

    streams, greedy = RowStreams(4, torch.device("cpu")), RowLaws(0.0, 4, torch.device("cpu"))
    drafter = RecordingDrafter(make_state(load_model(str(draft_path)).model, 4, 512), greedy, streams, 1)
    verifier = make_state(load_model(str(target_path)).model, 4, 512, capture=layers)
    level = RejectionLevel(verifier, drafter, 3, RowLaws(0.0, 4, torch.device("cpu")), streams, 2)
    rows = torch.tensor([0, 1])
    level.load_prompts(rows, [[5, 9, 13, 2], [7, 7]])
    level.prefill(rows)
    for _ in range(10):
        level.propose(rows, 1)
        level.commit(rows, 1)
    hf = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    for row in rows.tolist():
        seq = verifier.seq[row, : int(level.acknowledged[row])].tolist()
        with torch.no_grad():
            hidden = hf(torch.tensor([seq]), output_hidden_states=True).hidden_states
        expected = torch.cat([hidden[i][0] for i in layers], -1)
        for position in range(len(seq) - 1):  # the newest token is still pending
            got = drafter.seen[(row, position)]
            assert (got - expected[position]).abs().max() < 1e-4, (row, position)


def _hierarchy(bottom, mid, top, temperatures, gammas=(2, 3), rows=16, mid_layers=None):
    """[model bottom, rejection mid, rejection top]: a rejection level drafting for another (TriForce-style)."""
    t_bottom, t_mid, t_top = temperatures
    return HierarchicalDecoder.from_config(
        {
            "levels": [
                {"kind": "model", "model": str(bottom), "temperature": t_bottom},
                {
                    "kind": "rejection",
                    "model": str(mid),
                    "temperature": t_mid,
                    "num_draft_tokens": gammas[0],
                    "num_layers": mid_layers,
                },
                {"kind": "rejection", "model": str(top), "temperature": t_top, "num_draft_tokens": gammas[1]},
            ],
            "engine": {"kv_capacity_tokens": 16 * max(rows, 512), "max_batch_rows": rows},
        }
    )


@pytest.mark.parametrize("mid_t,gammas", [(0.0, (2, 5)), (1.0, (3, 3))], ids=["greedy-mid", "sampled-mid"])
def test_rejection_over_rejection_temperature_zero_equals_top_greedy(pair, mid_t, gammas):
    """The mid level is the top model cut to 3 layers, so its drafts are often but not always right; with
    γ_top > γ_mid + 1 it runs two cycles per top cycle."""
    draft, target = pair
    decoder = _hierarchy(draft, target, target, (1.0, mid_t, 0.0), gammas, mid_layers=3)
    prompts = [[5, 9, 13], [7] * 11, [40, 41, 42, 43, 44, 45], [3]]
    results = decoder.generate(prompts, max_new_tokens=24, ignore_eos=True)
    for prompt, result in zip(prompts, results):
        assert result.token_ids == _hf_greedy(target, prompt, 24)
    top_accepted = results[0].stats["levels"][2]["mean_accepted_length"]
    assert 1.0 < top_accepted < gammas[1] + 1, "the mid level's drafts should be partly accepted"
    assert_pools_empty(decoder)


@pytest.fixture(scope="module")
def small_vocab_mid(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("mid") / "mid", seed=5, vocab_size=VOCAB, eos_token_id=5)


@pytest.mark.parametrize(
    "temperatures", [(1.0, 0.8, 1.0), (0.0, 0.0, 1.0)], ids=["sampled-drafters", "greedy-drafters"]
)
def test_rejection_over_rejection_is_lossless_in_distribution(small_vocab_pair, small_vocab_mid, temperatures):
    """The top level verifies the mid level's drafts against the mid model's full distribution (sampled) or
    as one-hot greedy tokens: its output must be distributed exactly as its own model."""
    draft, target = small_vocab_pair
    prompt, n_samples = [1, 4, 2], 20_000
    decoder = _hierarchy(draft, small_vocab_mid, target, temperatures, gammas=(2, 2), rows=1024)
    results = decoder.generate([prompt] * n_samples, max_new_tokens=3, ignore_eos=True, seed=17)
    samples = [tuple(r.token_ids) for r in results]
    assert _chi2_pvalue(samples, _exact_first_tokens(target, prompt, 3)) > 1e-3
    mid_t = max(temperatures[1], 1.0)
    assert _chi2_pvalue(samples, _exact_first_tokens(small_vocab_mid, prompt, 3, mid_t)) < 1e-6  # power
    assert results[0].stats["levels"][2]["mean_accepted_length"] > 1.05, "the mid level's drafts should be used"
    assert_pools_empty(decoder)
