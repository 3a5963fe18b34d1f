"""hsmc's decoder through the KV pool equals transformers' model on the same weights (fp32)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import TINY_CONFIGS, make_tiny_model
from helpers import hf_logits, make_runner, run_new_tokens

from hsmc.engine.kv_pool import check_invariants
from hsmc.models.decoder import DecoderLM
from hsmc.models.loading import load_model

TOL = 1e-4
GSM8K_TEST = Path(__file__).resolve().parents[1] / "evals" / "data" / "gsm8k_test.jsonl"


class _Pairs(dict):
    """(hsmc model, transformers model) per name, loaded on first use and kept for the module."""

    def __init__(self, request):
        super().__init__()
        self.request = request

    def __missing__(self, name):
        from transformers import AutoModelForCausalLM

        if name == "smollm2":
            path = self.request.getfixturevalue("smollm2_dir")
        else:
            path = make_tiny_model(name, self.request.getfixturevalue("tmp_path_factory").mktemp(name))
        loaded = load_model(str(path))
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self[name] = Case(loaded.model, hf, _token_stream(loaded))
        return self[name]


@dataclass
class Case:
    ours: DecoderLM
    hf: object
    stream: list[int]  # token ids that test sequences are cut from

    def window(self, rng: random.Random, *lengths: int) -> list[list[int]]:
        """Consecutive pieces of one random window of the stream (a context and its continuations)."""
        start = rng.randrange(len(self.stream) - sum(lengths))
        pieces = []
        for n in lengths:
            pieces.append(self.stream[start : start + n])
            start += n
        return pieces


def _token_stream(loaded) -> list[int]:
    """Real text for a real model (GSM8K questions), random ids for a random one.

    Natural text keeps SmolLM2's activations in their usual range; with random ids its fp32
    logits differ from transformers' by ~1e-4 whichever order the sums run in (transformers'
    own batched and single-row forwards differ by 8e-5 there).
    """
    if loaded.tokenizer is None:
        return torch.randint(
            0, loaded.model.config.vocab_size, (4096,), generator=torch.Generator().manual_seed(0)
        ).tolist()
    questions = [json.loads(line)["question"] for line in open(GSM8K_TEST).readlines()[:40]]
    return loaded.tokenizer(" ".join(questions))["input_ids"]


@pytest.fixture(scope="module")
def pairs(request):
    return _Pairs(request)


@pytest.fixture(params=[*sorted(TINY_CONFIGS), pytest.param("smollm2", marks=pytest.mark.slow)])
def pair(request, pairs):
    return pairs[request.param]


def test_whole_prompt_prefill(pair):
    (ids,) = pair.window(random.Random(0), 23)
    (logits,), _ = run_new_tokens(make_runner(pair.ours), [0], [ids])
    assert (logits - hf_logits(pair.hf, ids)).abs().max() <= TOL


def test_token_by_token_decode(pair):
    (ids,) = pair.window(random.Random(1), 20)
    ref = hf_logits(pair.hf, ids)
    runner = make_runner(pair.ours)
    for t, tok in enumerate(ids):
        (logits,), _ = run_new_tokens(runner, [0], [[tok]])
        assert (logits[0] - ref[t]).abs().max() <= TOL, f"position {t}"
    assert int(runner.tables.length[0]) == len(ids)


def test_ragged_batch_of_1_to_9_new_tokens(pair):
    """Nine rows with different context lengths each bring 1..9 new tokens in one forward."""
    rng = random.Random(2)
    contexts, new = zip(*(pair.window(rng, n, k) for n, k in zip((5, 1, 12, 3, 8, 2, 17, 6, 9), range(1, 10))))
    runner = make_runner(pair.ours)
    rows = list(range(9))
    run_new_tokens(runner, rows, contexts)  # ragged prefill, itself one forward
    got, _ = run_new_tokens(runner, rows, new)
    for i in rows:
        ref = hf_logits(pair.hf, contexts[i] + new[i])[len(contexts[i]) :]
        assert (got[i] - ref).abs().max() <= TOL, f"row {i}"


def test_rows_sharing_a_prompt_through_copy_block_table(pair):
    rng = random.Random(3)
    prompt, *conts = pair.window(rng, 15, 2, 1, 4, 3)
    runner = make_runner(pair.ours)
    tables = runner.tables
    run_new_tokens(runner, [0], [prompt])
    before = tables.allocator.num_free()
    tables.copy_block_table(torch.tensor([0, 0, 0]), torch.tensor([1, 2, 3]))
    assert tables.allocator.num_free() == before, "fan-out must not allocate slots"
    assert torch.equal(tables.allocator.refcount[tables.table[0, :15]], torch.full((15,), 4, dtype=torch.int32))
    check_invariants(tables.allocator, [tables])
    got, _ = run_new_tokens(runner, [0, 1, 2, 3], conts)
    # a second step on every row: catches one row's writes landing in another's (shared) slots
    conts2 = [piece for (piece,) in (pair.window(rng, 2) for _ in range(4))]
    got2, _ = run_new_tokens(runner, [0, 1, 2, 3], conts2)
    for i in range(4):
        full = hf_logits(pair.hf, prompt + conts[i] + conts2[i])
        assert (got[i] - full[15 : 15 + len(conts[i])]).abs().max() <= TOL
        assert (got2[i] - full[15 + len(conts[i]) :]).abs().max() <= TOL
    check_invariants(tables.allocator, [tables])


def test_captured_residual_streams_equal_hidden_states(pair):
    n = pair.ours.config.num_layers
    capture = (2, n // 2, n - 3, 0)
    (ids,) = pair.window(random.Random(4), 11)
    runner = make_runner(pair.ours, capture=capture)
    first = 6
    _, (cap_a,) = run_new_tokens(runner, [0], [ids[:first]])
    _, (cap_b,) = run_new_tokens(runner, [0], [ids[first:]])
    got = torch.cat([cap_a, cap_b])  # [T, len(capture), H]
    with torch.no_grad():
        ref = pair.hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
    for j, layer in enumerate(capture):
        # SmolLM2's residual stream carries outlier dimensions near 25000, so fp32 rounding
        # anywhere in a row scales with that: allow ~8 ulps of the tensor's largest entry
        scale = max(TOL, 1e-6 * ref[layer].abs().max().item())
        assert (got[:, j] - ref[layer][0]).abs().max() <= scale, f"hidden_states[{layer}]"
