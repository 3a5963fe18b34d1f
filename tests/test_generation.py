"""Greedy decoding through the engine equals transformers' generate token for token."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model
from helpers import assert_pools_empty

from hsmc.decoder import HierarchicalDecoder
from hsmc.models.tokenizer import encode_prompt

CHAT_PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?",
    "Write a Python function that returns the factorial of n.",
]


def _decoder(model: str, **engine) -> HierarchicalDecoder:
    return HierarchicalDecoder.from_config(
        {
            "levels": [{"kind": "model", "model": model, "temperature": 0.0}],
            "engine": {"max_batch_rows": 8, "kv_capacity_tokens": 1024, **engine},
        }
    )


@torch.no_grad()
def _hf_greedy(hf, ids: list[int], max_new_tokens: int, **kw) -> list[int]:
    out = hf.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, **kw)
    return out[0, len(ids) :].tolist()


@pytest.mark.slow
def test_smollm2_greedy_chat_equals_transformers_generate(smollm2_dir):
    """Three chat prompts decoded together in one batch; the first ends (EOS) long before the others."""
    from transformers import AutoModelForCausalLM

    decoder = _decoder(str(smollm2_dir))
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    results = decoder.generate(CHAT_PROMPTS, max_new_tokens=64)
    for prompt, result in zip(CHAT_PROMPTS, results):
        ids = encode_prompt(decoder.tokenizer, prompt, chat_template=True)
        assert result.token_ids == _hf_greedy(hf, ids, 64)
    assert [r.finish_reason for r in results] == ["stop", "length", "length"]
    assert "Paris" in results[0].text


def test_tiny_models_greedy_equals_transformers(tmp_path):
    """Random-weight models of each architecture, prompts of different lengths in one batch,
    more prompts than batch rows (two admission waves)."""
    from transformers import AutoModelForCausalLM

    for arch in ("llama", "qwen2", "qwen3"):
        path = make_tiny_model(arch, tmp_path / arch, seed=5)
        decoder = _decoder(str(path), max_batch_rows=2)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        gen = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, 80, (n,), generator=gen).tolist() for n in (3, 11, 6)]
        results = decoder.generate(prompts, max_new_tokens=20, ignore_eos=True)
        for prompt, result in zip(prompts, results):
            assert result.token_ids == _hf_greedy(hf, prompt, 20, min_new_tokens=20), arch
        assert_pools_empty(decoder)


def test_sampling_is_reproducible_from_seed(tmp_path):
    path = make_tiny_model("llama", tmp_path / "m")
    decoder = HierarchicalDecoder.from_config(
        {"levels": [{"model": str(path), "temperature": 1.0}], "engine": {"kv_capacity_tokens": 512}}
    )
    prompts = [[5, 6, 7], [9, 10]]
    a = decoder.generate(prompts, max_new_tokens=16, seed=3, ignore_eos=True)
    b = decoder.generate(prompts, max_new_tokens=16, seed=3, ignore_eos=True)
    c = decoder.generate(prompts, max_new_tokens=16, seed=4, ignore_eos=True)
    assert [r.token_ids for r in a] == [r.token_ids for r in b]
    assert [r.token_ids for r in a] != [r.token_ids for r in c]


@pytest.mark.slow
@pytest.mark.parametrize("stack", ["model", "smc"])
def test_stop_strings_end_generation_and_trim_the_text(smollm2_dir, stack):
    levels = [{"model": str(smollm2_dir), "temperature": 0.0 if stack == "model" else 0.5}]
    if stack == "smc":
        levels.append({"kind": "smc", "model": str(smollm2_dir), "temperature": 0.5, "particles": 2, "block_size": 3})
    decoder = HierarchicalDecoder.from_config({"levels": levels, "generation": {"stop": ["Paris"]}})
    full = decoder.generate(CHAT_PROMPTS[:1], max_new_tokens=16, stop=[])[0]
    assert "Paris" in full.text
    result = decoder.generate(CHAT_PROMPTS[:1], max_new_tokens=16)[0]
    assert result.finish_reason == "stop" and "Paris" not in result.text
    assert result.text == full.text[: full.text.index("Paris")]
    assert "Paris" in decoder.tokenizer.decode(result.token_ids)  # tokens run up to the one completing it


@pytest.mark.parametrize("top", ["model", "rejection", "smc"])
def test_continuous_batching_admits_a_prompt_as_soon_as_rows_free(tmp_path, top):
    """Rows for two requests, three prompts; the first ends at its first token (the target's EOS is chosen to be
    that token), so the third joins while the second decodes: the top level's forwards are those of one prompt
    alone plus a few (one after another would be twice as many), every output equals the prompt decoded alone,
    and the pools end empty. Near-zero temperatures make every level's draws argmaxes (SMC particles agree)."""
    draft = make_tiny_model("llama", tmp_path / "draft", seed=3)
    first = [5, 17, 33]
    probe = _decoder(str(make_tiny_model("llama", tmp_path / "probe", seed=5)))
    eos = probe.generate([first], max_new_tokens=1, ignore_eos=True)[0].token_ids[0]
    target = str(make_tiny_model("llama", tmp_path / "target", seed=5, eos_token_id=eos))
    levels = {
        "model": [{"model": target, "temperature": 0.0}],
        "rejection": [  # a self-draft: every draft is kept, so the drafter holds two unprocessed tokens per row
            {"model": target, "temperature": 0.0},
            {"kind": "rejection", "model": target, "temperature": 0.0, "num_draft_tokens": 3},
        ],
        "smc": [
            {"model": str(draft), "temperature": 1e-4},
            {"kind": "smc", "model": target, "temperature": 1e-4, "particles": 2, "block_size": 3},
        ],
    }[top]
    rows_per_prompt = 2 if top == "smc" else 1

    def run(prompts: list[list[int]], rows: int) -> tuple[list[list[int]], int]:
        decoder = HierarchicalDecoder.from_config(
            {"levels": levels, "engine": {"max_batch_rows": rows, "kv_capacity_tokens": 1024}}
        )
        results = decoder.generate(prompts, max_new_tokens=20)
        assert_pools_empty(decoder)
        return [r.token_ids for r in results], results[0].stats["levels"][-1]["forwards"]

    second, third = [60, 85, 28, 90], [4, 56, 72]  # both run to the length limit: no EOS in their outputs
    (alone_second,), forwards_second = run([second], 8)
    (alone_third,), forwards_third = run([third], 8)
    assert len(alone_second) == len(alone_third) == 20
    outputs, forwards = run([first, second, third], 2 * rows_per_prompt)
    assert outputs == [[eos], alone_second, alone_third]
    assert forwards <= max(forwards_second, forwards_third) + 3 < forwards_second + forwards_third


@pytest.mark.parametrize("top", ["rejection", "smc"])
def test_a_second_call_runs_forwards_as_narrow_as_the_first(tmp_path, top, monkeypatch):
    """Bounds left by the rows of an earlier call must not widen the next call's forwards (a wider first step
    is wasted work, and on CUDA a new graph to capture): two identical calls run forwards of the same widths."""
    from hsmc.levels.base import SequenceState

    draft = str(make_tiny_model("llama", tmp_path / "draft", seed=3))
    target = str(make_tiny_model("llama", tmp_path / "target", seed=5))
    middle = {"rejection": {"kind": "rejection", "model": target, "num_draft_tokens": 3}}.get(top)
    smc = {"kind": "smc", "model": target, "temperature": 1.0, "particles": 2, "block_size": 3}
    levels = [{"model": draft, "temperature": 1.0}, middle or smc]
    decoder = HierarchicalDecoder.from_config({"levels": levels, "engine": {"kv_capacity_tokens": 1024}})
    widths: list[tuple[int, int]] = []
    forward = SequenceState.forward

    def recording(state, rows, leave_last=False, last_only=False):
        widths.append((id(state), max(state.prompt_lengths, default=0) or state.pending_bound))
        return forward(state, rows, leave_last, last_only)

    monkeypatch.setattr(SequenceState, "forward", recording)
    decoder.generate([[5, 9, 13], [7] * 6], max_new_tokens=12, ignore_eos=True, seed=1)
    first, widths[:] = list(widths), []
    decoder.generate([[5, 9, 13], [7] * 6], max_new_tokens=12, ignore_eos=True, seed=1)
    assert widths == first
