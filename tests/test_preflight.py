"""Checks before loading: config, prompts, prompts file, model files and KV sizing all fail before any
weights are read (the loaders are replaced by a tripwire), and the config-only KV sizing agrees with
the built stack's."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from conftest import TINY_CONFIGS, make_tiny_model
from test_eagle_checkpoint import published_layout

from hsmc.cli import main
from hsmc.config import load_config
from hsmc.decoder import HierarchicalDecoder
from hsmc.engine.scheduler import rows_and_lookahead
from hsmc.errors import PromptError
from hsmc.preflight import check_before_loading


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("preflight") / "llama")


@pytest.fixture
def no_weights(monkeypatch):
    """Any attempt to read weights fails the test."""
    import hsmc.decoder
    import hsmc.models.loading

    def tripwire(*args, **kwargs):
        raise AssertionError("weights were read before the checks failed")

    monkeypatch.setattr(hsmc.decoder, "build_stack", tripwire)
    monkeypatch.setattr(hsmc.models.loading, "load_decoder", tripwire)


def _run(tmp_path, levels, *argv, **sections):
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"levels": levels, **sections}))
    return main(["generate", "--config", str(config), *argv])


def _ids_file(tmp_path, prompts):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return str(path)


def _error(capsys) -> str:
    (line,) = capsys.readouterr().err.strip().splitlines()
    return line


KV_64 = ("engine.kv_capacity_tokens=64", "generation.max_new_tokens=16")


def test_prompt_too_long_for_the_kv_pool(tiny, tmp_path, capsys, no_weights):
    prompts = _ids_file(tmp_path, [[1, 2, 3], list(range(3, 63))])
    assert _run(tmp_path, [{"model": str(tiny)}], "--prompts-file", prompts, *KV_64) == 2
    line = _error(capsys)
    assert line.startswith("hsmc: error: prompt 1 has 60 tokens; with max_new_tokens=16")
    assert "engine.kv_capacity_tokens=64" in line


def test_missing_prompts_file(tiny, tmp_path, capsys, no_weights):
    assert _run(tmp_path, [{"model": str(tiny)}], "--prompts-file", str(tmp_path / "absent.txt")) == 2
    assert _error(capsys) == f"hsmc: error: --prompts-file: no such file {tmp_path / 'absent.txt'}"


def test_no_prompts_at_all(tiny, tmp_path, capsys, no_weights):
    assert _run(tmp_path, [{"model": str(tiny)}]) == 2
    assert _error(capsys) == "hsmc: error: no prompts: pass --prompt, --prompts-file, or set `prompts` in the config"


def test_text_prompt_for_a_model_without_tokenizer(tiny, tmp_path, capsys, no_weights):
    assert _run(tmp_path, [{"model": str(tiny)}], "--prompt", "hello") == 2
    assert "this model has no tokenizer files: pass prompts as lists of token ids" in _error(capsys)


def test_stop_strings_without_a_tokenizer(tiny, tmp_path, capsys, no_weights):
    argv = ("--prompts-file", _ids_file(tmp_path, [[3, 4]]), "generation.stop=[x]")
    assert _run(tmp_path, [{"model": str(tiny)}], *argv) == 2
    assert _error(capsys) == "hsmc: error: generation.stop needs a tokenizer, and this model folder ships none"


def test_num_layers_beyond_the_model(tiny, tmp_path, capsys, no_weights):
    argv = ("--prompts-file", _ids_file(tmp_path, [[3, 4]]), "levels.0.num_layers=9")
    assert _run(tmp_path, [{"model": str(tiny)}], *argv) == 2
    assert _error(capsys) == f"hsmc: error: levels[0] (model): num_layers=9, but {tiny} has 5 layers"


def test_empty_prompt_and_a_truncated_eagle3_head(tiny, tmp_path, capsys, no_weights):
    llama = TINY_CONFIGS["llama"]
    sizes = (llama["hidden_size"], llama["num_attention_heads"], llama["num_key_value_heads"], 16, 96, 101, 40)
    head, _ = published_layout(tmp_path / "head", dtype=torch.float32, sizes=sizes)
    levels = [{"kind": "eagle3", "model": str(head)}, {"kind": "rejection", "model": str(tiny)}]
    assert _run(tmp_path, levels, "--prompts-file", _ids_file(tmp_path, [[3, 4], []])) == 2
    assert _error(capsys) == "hsmc: error: prompt 1 ([]) has no tokens"
    weights = head / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-10])
    assert _run(tmp_path, levels, "--prompts-file", _ids_file(tmp_path, [[3, 4]])) == 2
    assert _error(capsys).startswith(f"hsmc: error: levels[0] (eagle3): {weights}: not a readable safetensors file")


def test_checks_pass_for_a_run_that_fits(tiny):
    cfg = load_config({"levels": [{"model": str(tiny)}]}, KV_64)
    prompts = [[1, 2, 3], list(range(3, 20))]
    assert check_before_loading(cfg, prompts) == prompts
    with pytest.raises(PromptError, match="no prompts"):
        check_before_loading(cfg, [])


SMC = {"kind": "smc", "model": "M", "temperature": 1.0}


@pytest.mark.parametrize(
    "levels",
    [
        [{"model": "M"}],
        [{"model": "M", "temperature": 1.0}, {"kind": "rejection", "model": "M", "num_draft_tokens": 3}],
        [{"model": "M", "temperature": 1.0}, {**SMC, "particles": 3, "block_size": 2}],
        [{"model": "M", "temperature": 1.0}, {"kind": "rejection", "model": "M", "temperature": 1.0}, SMC],
    ],
)
def test_kv_sizing_from_the_config_matches_the_built_stack(tiny, levels):
    cfg = load_config({"levels": [{**lc, "model": str(tiny)} for lc in levels]})
    stack = HierarchicalDecoder(cfg).stack
    assert rows_and_lookahead(cfg) == (stack.rows_per_prompt, stack.lookahead)
