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
