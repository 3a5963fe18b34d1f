"""A .gguf model is dequantized once into `$HSMC_CACHE/gguf/` and loaded from there afterwards.

transformers' GGUF reader is stood in for by a tiny model folder (and counted), so these tests run the
cache's own logic in seconds; the slow test at the end converts the real SmolLM2 GGUF."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import make_tiny_model, save_tokenizer

from hsmc.errors import ChecksumError, ModelLoadError
from hsmc.models.gguf import RECORD, check_conversion
from hsmc.models.loading import load_model


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """A .gguf path whose 'dequantization' loads a tiny model folder; returns (path, reference folder, calls)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reference = save_tokenizer(make_tiny_model("llama", tmp_path / "reference", seed=3), list("abcdefgh"), eos="h")
    gguf = tmp_path / "user-model.Q4_0.gguf"
    gguf.write_bytes(b"GGUF stand-in")
    calls = []
    real_model, real_tokenizer = AutoModelForCausalLM.from_pretrained, AutoTokenizer.from_pretrained

    def model_from_gguf(folder, gguf_file=None, **kwargs):
        calls.append(gguf_file)
        if gguf.read_bytes() == b"broken":
            raise ValueError("not a GGUF file")
        return real_model(reference, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", model_from_gguf)
    monkeypatch.setattr(
        AutoTokenizer, "from_pretrained", lambda folder, gguf_file=None, **kw: real_tokenizer(reference)
    )
    monkeypatch.setenv("HSMC_CACHE", str(tmp_path / "cache"))
    return gguf, reference, calls


def _same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_gguf_is_converted_once(fake_gguf, tmp_path):
    gguf, reference, calls = fake_gguf
    first = load_model(str(gguf))
    second = load_model(str(gguf))
    assert calls == [gguf.name], "the second load must come from the cache"
    assert _same_weights(first.model, second.model)
    assert _same_weights(second.model, load_model(str(reference)).model)
    assert second.tokenizer.decode([0, 1, 2]) == "abc"
    (folder,) = (tmp_path / "cache" / "gguf").iterdir()
    assert folder.name.startswith("user-model.Q4_0-")
    check_conversion(folder, hashes=True)


def test_a_changed_file_is_converted_again(fake_gguf):
    gguf, _, calls = fake_gguf
    load_model(str(gguf))
    stat = gguf.stat()
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # edited in place
    load_model(str(gguf))
    assert len(calls) == 2


def test_a_damaged_conversion_is_reported(fake_gguf, tmp_path):
    gguf, _, _ = fake_gguf
    load_model(str(gguf))
    (folder,) = (tmp_path / "cache" / "gguf").iterdir()
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])  # truncated
    with pytest.raises(ChecksumError, match=f"model.safetensors.*delete {folder}"):
        load_model(str(gguf))
    (folder / RECORD).unlink()
    with pytest.raises(ChecksumError, match="not a complete hsmc conversion"):
        load_model(str(gguf))


def test_a_failed_conversion_leaves_nothing_behind(fake_gguf, tmp_path):
    gguf, _, _ = fake_gguf
    gguf.write_bytes(b"broken")
    with pytest.raises(ModelLoadError, match="transformers could not read this GGUF file"):
        load_model(str(gguf))
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


@pytest.mark.slow
def test_real_gguf_converts_once_to_the_demo_weights(smollm2_dir, tmp_path, monkeypatch):
    """The SmolLM2 GGUF through the cache: the same weights and chat template as the demo model's folder."""
    from hsmc.models.demo import DEMO_MODELS, cache_dir

    gguf = cache_dir() / DEMO_MODELS["smollm2-135m-instruct"].member.split("/")[-1]
    monkeypatch.setenv("HSMC_CACHE", str(tmp_path))
    loaded = load_model(str(gguf))
    assert loaded.tokenizer is not None and loaded.tokenizer.chat_template
    assert _same_weights(loaded.model, load_model(str(smollm2_dir)).model)
    (folder,) = (tmp_path / "gguf").iterdir()
    check_conversion(folder, hashes=True)
