"""Streaming: what has been handed out is final. Increments join to a prefix of the final output at every
point (tokens and text), and to all of it at the end; for an smc top they are the particles' consensus."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_model, save_tokenizer
from tokenizers.pre_tokenizers import ByteLevel

from hsmc.cli import main
from hsmc.decoder import HierarchicalDecoder
from hsmc.streaming import TextStream, common_prefix_length

EOS = "<eos>"
BYTES = sorted(ByteLevel.alphabet())  # token i < 256 is one byte: random ids make broken UTF-8 and whitespace


@pytest.fixture(scope="module")
def byte_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("bytes")
    folders = []
    for name, seed in (("draft", 31), ("target", 32)):
        folder = make_tiny_model("llama", root / name, seed=seed, vocab_size=257, eos_token_id=256)
        folders.append(save_tokenizer(folder, [*BYTES, EOS], eos=EOS))
    return folders


def _prefix_checking_stream(decoder, prompts, **generation) -> tuple[int, int, list]:
    """Collect the increments, then check every running join against the final output."""
    increments = list(decoder.stream(prompts, **generation))
    results = {inc.index: inc.result for inc in increments if inc.result is not None}
    assert sorted(results) == list(range(len(prompts)))
    tokens = {i: [] for i in results}
    texts = {i: "" for i in results}
    early = 0
    for inc in increments:
        i, final = inc.index, results[inc.index]
        tokens[i] += inc.token_ids
        texts[i] += inc.text
        assert final.token_ids[: len(tokens[i])] == tokens[i]
        assert final.text.startswith(texts[i])
        if inc.result is None:
            early += len(inc.token_ids)
    for i, final in results.items():
        assert tokens[i] == final.token_ids and texts[i] == final.text
    return early, sum(len(r.token_ids) for r in results.values()), list(results.values())


@pytest.mark.parametrize("kind", ["model", "rejection"])
def test_increments_of_committed_tokens_join_to_a_prefix_of_the_output(byte_models, kind):
    draft, target = byte_models
    levels = [{"kind": "model", "model": str(draft if kind == "rejection" else target), "temperature": 1.0}]
    if kind == "rejection":
        levels.append({"kind": "rejection", "model": str(target), "temperature": 1.0, "num_draft_tokens": 3})
    decoder = HierarchicalDecoder.from_config({"levels": levels, "engine": {"kv_capacity_tokens": 8192}})
    prompts = [[i, 100 + i] for i in range(12)]
    early, total, results = _prefix_checking_stream(
        decoder, prompts, max_new_tokens=40, stop=["\n\n", "ab", "x"], seed=1, chat_template=False
    )
    assert early > total / 2, "most tokens should be handed out before their request finishes"
    assert any(r.finish_reason == "stop" for r in results)


def test_smc_consensus_prefix_is_always_a_prefix_of_the_final_output(byte_models):
    """Property over seeds: the consensus handed out while the particles run is never contradicted by the
    particle finally returned (resampling happens, particles finish at different times)."""
    draft, target = byte_models
    smc = {"kind": "smc", "model": str(target), "temperature": 1.0, "particles": 4, "block_size": 3, "alpha": 2.0}
    levels = [{"kind": "model", "model": str(draft), "temperature": 1.0}, {**smc, "ess_threshold": 0.7}]
    decoder = HierarchicalDecoder.from_config(
        {"levels": levels, "engine": {"kv_capacity_tokens": 16384, "max_batch_rows": 64}}
    )
    prompts = [[i, 50 + i] for i in range(16)]
    early = total = resamplings = 0
    for seed in range(6):
        e, t, results = _prefix_checking_stream(decoder, prompts, max_new_tokens=24, stop=["ab"], seed=seed)
        early, total = early + e, total + t
        resamplings += sum(r.smc.resamplings for r in results)
        for r in results:
            particles = [p.token_ids for p in r.smc.particles]
            assert r.token_ids == particles[r.smc.chosen]
    assert resamplings > 0
    assert 0 < early < total, "some consensus should settle before the end, not everything"


class _CharTokenizer:
    """decode() of ids as characters, with the clean-up a tokenizer may apply to ' .'."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids).replace(" .", ".")


def test_text_stream_holds_back_what_a_later_token_can_change():
    from hsmc.stopping import StopCriteria

    stream = TextStream(_CharTokenizer(), StopCriteria(frozenset(), ("STOP",), _CharTokenizer()))
    shown = ""
    for text in ["Hi", "Hi ", "Hi .", "Hi . S", "Hi . ST", "Hi . STx"]:
        shown += stream.update([ord(c) for c in text])
        assert (text.replace(" .", ".")).startswith(shown)
    assert shown == "Hi. STx"  # " " waited for "." (cleaned up to "."), "S"/"ST" waited as a stop string's start
    assert stream.finish([ord(c) for c in "Hi . STxy STOP"]) == "y "  # trimmed at the stop string


class _CountingTokenizer:
    """A real tokenizer's decode, counting the tokens it is given."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids, skip_special_tokens=False):
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.mark.parametrize("vocab", ["bytes", "smollm2"])
def test_text_stream_decodes_only_new_tokens_and_keeps_the_text_of_all(byte_models, smollm2_dir, vocab):
    """Random tokens (broken UTF-8 from byte tokens, SmolLM2's merges and special tokens), 1-4 a step: at every
    update the text so far is exactly the decode of all tokens read so far, what was shown is a prefix of the final
    text, and a step decodes a few tokens, not all of them (all of them each step: ~n²/2 = 125,000 tokens here)."""
    from transformers import AutoTokenizer

    from hsmc.stopping import StopCriteria

    tokenizer = AutoTokenizer.from_pretrained(byte_models[1] if vocab == "bytes" else smollm2_dir)
    counting = _CountingTokenizer(tokenizer)
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, len(tokenizer), (500,), generator=generator).tolist()
    stream, shown, read = TextStream(counting, StopCriteria(frozenset(), ())), "", 0
    steps = torch.randint(1, 5, (500,), generator=generator).tolist()
    while read < len(tokens):
        read = min(len(tokens), read + steps.pop())
        shown += stream.update(tokens[:read])
        assert stream.decoded == tokenizer.decode(tokens[: stream.read], skip_special_tokens=True)
        assert tokenizer.decode(tokens[:read], skip_special_tokens=True).startswith(shown)
    assert counting.decoded < 20 * len(tokens)
    shown += stream.finish(tokens)
    assert shown == tokenizer.decode(tokens, skip_special_tokens=True)


def test_common_prefix_length():
    assert common_prefix_length([[1, 2, 3], [1, 2, 4], [1, 2]]) == 2
    assert common_prefix_length([[5], [6]]) == 0
    assert common_prefix_length([[1, 2, 3]], known=1) == 3


def test_cli_stream_and_json(tmp_path, byte_models, capsys):
    draft, target = byte_models
    config = tmp_path / "stack.yaml"
    config.write_text(
        json.dumps(
            {
                "levels": [
                    {"kind": "model", "model": str(draft), "temperature": 1.0},
                    {"kind": "smc", "model": str(target), "temperature": 1.0, "particles": 3, "block_size": 2},
                ],
                "generation": {"max_new_tokens": 12, "chat_template": False},
                "prompts": ["hello", "abc"],
            }
        )
    )
    assert main(["generate", "--config", str(config), "--json"]) == 0
    results = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in results] == ["hello", "abc"]
    for r in results:
        assert (
            len(r["smc"]["particles"]) == 3 and r["token_ids"] == r["smc"]["particles"][r["smc"]["chosen"]]["token_ids"]
        )
        assert isinstance(r["smc"]["log_z"], float) and r["smc"]["resamplings"] >= 0
    assert main(["generate", "--config", str(config), "--stream", "--json"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    finals = {line["index"]: line["result"] for line in lines if line["result"]}
    for i in (0, 1):
        joined = "".join(line["text"] for line in lines if line["index"] == i)
        assert joined == finals[i]["text"] == results[i]["text"]  # same seed, same output
    assert main(["generate", "--config", str(config), "--stream"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"### hello\n{results[0]['text']}\n\n### abc\n{results[1]['text']}\n")
    assert "tok/s" in out and "resample_rate" in out
