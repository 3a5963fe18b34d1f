"""engine.kv_capacity_tokens: auto — KV pools sized from the memory free after the weights (mocked here)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import make_tiny_model

import hsmc.levels.stack
import hsmc.preflight
from hsmc.config import load_config
from hsmc.decoder import HierarchicalDecoder
from hsmc.engine.kv_sizing import MARGIN, RESERVE_BYTES, auto_capacity, most_useful_tokens, reserve_bytes
from hsmc.errors import KVCapacityError
from hsmc.models.size import weight_bytes
from hsmc.preflight import check_before_loading

GIB = 2**30
VOCAB = 101  # the tiny llama's


def test_capacity_is_free_memory_less_the_reserve_over_the_summed_per_token_bytes():
    per_token = [256 * 1024, 144 * 1024, 4 * 1024]  # Qwen3-32B bf16, Qwen3-8B bf16, an EAGLE3 head
    free = 30 * GIB
    fits = (int(free * (1 - MARGIN)) - RESERVE_BYTES) // (404 * 1024)
    assert auto_capacity(free, per_token, 1000, "free", most_tokens=10**9, reserve=RESERVE_BYTES) == fits
    assert auto_capacity(free, per_token, 1000, "free", most_tokens=fits // 2, reserve=RESERVE_BYTES) == fits // 2
    with pytest.raises(KVCapacityError) as e:
        auto_capacity(3 * GIB, per_token, 10000, "free after the weights", most_tokens=10**9, reserve=RESERVE_BYTES)
    message = str(e.value)
    assert "\n" not in message
    reserve = f"{RESERVE_BYTES / GIB:.1f} GiB reserve"
    for fragment in ("3.0 GiB free after the weights", reserve, "404 KiB per slot (3 models)", "10000"):
        assert fragment in message, fragment


def test_pools_stop_at_the_longest_useful_context_and_at_int32_offsets():
    from hsmc.models.config import DecoderConfig
    from hsmc.models.shapes import hf_config

    qwen06 = DecoderConfig.from_hf(hf_config("qwen3-0.6b"))  # 8 KV heads x 128: 1024 elements per slot
    assert most_useful_tokens([qwen06], 4) == 4 * qwen06.max_position_embeddings
    assert most_useful_tokens([qwen06], 512) == (2**31 - 1) // 1024 - 1  # a layer's cache stays int32-indexable


def test_reserve_holds_the_widest_forwards_logits():
    levels = [
        {"model": "a", "temperature": 1.0},
        {"kind": "rejection", "model": "b", "num_draft_tokens": 4, "temperature": 1.0},
        {"kind": "smc", "model": "c", "temperature": 1.0, "particles": 8, "block_size": 8},
    ]
    cfg = load_config({"levels": levels, "engine": {"max_batch_rows": 128}})
    # 128 rows x 9 tokens (the smc block + bonus, wider than the 5 of a verify) x 151936 fp32 logits, 4 copies
    assert reserve_bytes(cfg, 151936) == RESERVE_BYTES + 4 * 128 * 9 * 151936 * 4
    # with CUDA graphs the graphs' pool holds a round's 4 copies of 5 positions or a cycle's 2 of 9: the larger
    graphed = load_config({"levels": levels, "engine": {"max_batch_rows": 128, "device": "cuda"}})
    assert reserve_bytes(graphed, 151936) == RESERVE_BYTES + (4 * 9 + 4 * 5) * 128 * 151936 * 4
    # a warmup captures every batch size's cycles: ten copies of the widest block's logits more
    warm = load_config({"levels": levels, "engine": {"max_batch_rows": 128, "device": "cuda", "warmup": True}})
    assert reserve_bytes(warm, 151936) == RESERVE_BYTES + (4 * 9 + 4 * 5 + 10 * 9) * 128 * 151936 * 4
    levels[1]["num_draft_tokens"] = 1
    graphed = load_config({"levels": levels, "engine": {"max_batch_rows": 128, "device": "cuda"}})
    assert reserve_bytes(graphed, 151936) == RESERVE_BYTES + (4 * 9 + 2 * 9) * 128 * 151936 * 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama"))


def config(tiny, **engine):
    levels = [
        {"model": str(tiny), "num_layers": 2, "temperature": 0.0},  # a truncated self-draft: a second model
        {"kind": "rejection", "model": str(tiny), "num_draft_tokens": 3},
    ]
    engine = {"kv_capacity_tokens": "auto", "max_batch_rows": 4, **engine}
    return load_config({"levels": levels, "engine": engine, "generation": {"max_new_tokens": 12}})


def tiny_reserve(cfg) -> int:
    """The reserve of a `config(tiny)` stack: both models are the tiny Llama in fp32, whose prefill holds
    3 x 64 (stream) + 2 x 64 (q, attention out) + 2 x 32 (k, v) + 3 x 96 (gate, up, SiLU) = 672 floats per token."""
    return reserve_bytes(cfg, VOCAB, prefill_activations=cfg.engine.prefill_chunk_tokens * 672 * 4)


def test_a_larger_prefill_chunk_reserves_its_activations(tiny, monkeypatch):
    per_token = (2 + 5) * 2 * 2 * 16 * 4 + 2 * 8 * 5  # KV of both models and their block-table columns
    small, large = config(tiny, prefill_chunk_tokens=1024), config(tiny, prefill_chunk_tokens=1024 + 256)
    free_after_weights = -(-(900 * per_token + tiny_reserve(small)) // (1 - MARGIN))
    monkeypatch.setattr(hsmc.preflight, "free_memory", lambda device: free_after_weights + stack_weights(tiny))
    assert hsmc.preflight.estimated_sizes(small)[1] == 900
    assert hsmc.preflight.estimated_sizes(large)[1] == 900 - -(-256 * 672 * 4 // per_token)


def stack_weights(tiny) -> int:
    from hsmc.models.loading import load_model

    return weight_bytes(load_model(str(tiny), num_layers=2).model) + weight_bytes(load_model(str(tiny)).model)


def test_auto_pools_hold_what_the_free_memory_holds_and_preflight_predicts_it(tiny, monkeypatch):
    cfg = config(tiny)
    # tiny llama: 2 KV heads x 16 dims in fp32; the draft keeps 2 layers, the target has 5; plus one
    # int64 block-table column per level for the 4 rows and the scratch row
    per_token = (2 + 5) * 2 * 2 * 16 * 4 + 2 * 8 * 5
    slots = 700  # below the 4 rows x 256 positions past which more slots are of no use
    free_after_weights = -(-(slots * per_token + tiny_reserve(cfg)) // (1 - MARGIN))
    weights = stack_weights(tiny)
    monkeypatch.setattr(hsmc.preflight, "free_memory", lambda device: free_after_weights + weights)
    monkeypatch.setattr(hsmc.levels.stack, "free_memory", lambda device: free_after_weights)
    assert hsmc.preflight.estimated_sizes(cfg)[1] == slots  # from the configs alone: nothing loaded
    decoder = HierarchicalDecoder(cfg)
    assert decoder.stack.capacity == slots
    assert [level.state.runner.cache.num_slots for level in decoder.stack.levels] == [slots, slots]
    explicit = HierarchicalDecoder(config(tiny, kv_capacity_tokens=slots))
    prompts = [[5, 6, 7], [9, 10]]
    assert [r.token_ids for r in decoder.generate(prompts)] == [r.token_ids for r in explicit.generate(prompts)]
    monkeypatch.setattr(hsmc.preflight, "free_memory", lambda device: 100 * free_after_weights + weights)
    assert hsmc.preflight.estimated_sizes(cfg)[1] == 4 * 256  # every row at the models' longest context


def test_too_little_memory_fails_before_loading_and_names_the_numbers(tiny, monkeypatch):
    cfg = config(tiny)
    weights = stack_weights(tiny)

    def tripwire(*args, **kwargs):
        raise AssertionError("weights were loaded before the KV check failed")

    monkeypatch.setattr(hsmc.levels.stack, "load_model", tripwire)
    monkeypatch.setattr(hsmc.preflight, "free_memory", lambda device: weights + tiny_reserve(cfg))
    with pytest.raises(KVCapacityError, match=r"GiB estimated free after 0\.0 GiB of weights.*holds 0 KV slots"):
        check_before_loading(cfg, [[5, 6, 7]])


def test_built_stack_that_does_not_fit_names_the_numbers(tiny, monkeypatch):
    per_token = (2 + 5) * 2 * 2 * 16 * 4 + 2 * 8 * 5
    free = -(-(10 * per_token + tiny_reserve(config(tiny))) // (1 - MARGIN))
    monkeypatch.setattr(hsmc.levels.stack, "free_memory", lambda device: free)
    # one prompt needs 12 new tokens + 8 of lookahead (3 drafts + 1 bonus, and one overlapped cycle)
    with pytest.raises(
        KVCapacityError,
        match=r"GiB free after the weights.*holds 10 KV slots at 2 KiB per slot "
        r"\(2 models\), fewer than the 20 one prompt needs",
    ):
        HierarchicalDecoder(config(tiny))


def real_shape_folders(root):
    """config.json of Qwen3-8B and -32B (bf16 and Qwen's FP8 layout) and of an EAGLE3 head for the 8B, with a
    placeholder weight file: what preflight reads, no weights."""
    import json

    from safetensors.torch import save_file

    from hsmc.eagle.checkpoint import new_head_config
    from hsmc.models.shapes import hf_config

    fp8 = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic", "fmt": "e4m3"}
    configs = {}
    for shape in ("qwen3-8b", "qwen3-32b"):
        config = hf_config(shape).to_dict()
        configs[shape], configs[f"{shape}-fp8"] = config, {**config, "quantization_config": fp8}
    configs["head"] = new_head_config(configs["qwen3-8b"], 32000)
    for name, config in configs.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
        save_file({"placeholder": torch.zeros(1)}, root / name / "model.safetensors")
    return {name: str(root / name) for name in configs}


@pytest.mark.parametrize(
    "variant,free_gib,fits",
    [("-fp8", 79.0, True), ("", 139.0, True), ("", 79.0, False)],
    ids=["fp8-on-h100", "bf16-on-h200", "bf16-on-h100"],
)
def test_headline_stack_memory_by_the_preflight_estimate(tmp_path, monkeypatch, variant, free_gib, fits):
    """configs/qwen3_32b.yaml's stack (FP8) fits one H100 80 GB with a full admission wave; the bf16 variant
    fits an H200 and is refused on an H100 before anything loads."""
    folders = real_shape_folders(tmp_path)
    cfg = load_config(
        Path(__file__).resolve().parents[1] / "configs" / "qwen3_32b.yaml",
        [f"levels.0.model={folders['head']}", f"levels.1.model={folders['qwen3-8b' + variant]}",
         f"levels.2.model={folders['qwen3-32b' + variant]}"],
    )  # fmt: skip
    monkeypatch.setattr(hsmc.preflight, "free_memory", lambda device: int(free_gib * GIB))
    if not fits:
        with pytest.raises(KVCapacityError, match="2.0 GiB estimated free after 77.0 GiB of weights"):
            hsmc.preflight.estimated_sizes(cfg)[1]
        return
    slots = hsmc.preflight.estimated_sizes(cfg)[1]
    wave = 8 * (6 * (1024 + 22) + 2048)  # 48 rows: 8 prompts of 2048 tokens x 6 particles x (1024 new + lookahead)
    assert slots >= wave, slots


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_auto_on_a_machine_without_cuda_is_one_config_error(tiny, tmp_path, capsys):
    import yaml

    from hsmc.cli import main

    path = tmp_path / "cuda.yaml"
    path.write_text(yaml.safe_dump({"levels": [{"model": str(tiny)}], "engine": {"device": "cuda"}}))
    prompts = tmp_path / "ids.jsonl"
    prompts.write_text('{"prompt": [1, 2, 3]}\n')
    assert main(["generate", "--config", str(path), "--prompts-file", str(prompts)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["hsmc: error: engine.device='cuda' but no CUDA device is available"]


def test_auto_rows_are_the_most_whose_requests_fit_and_the_cpu_keeps_sixteen():
    """engine.max_batch_rows: auto (the CUDA default): the largest power of two <= 256 whose logits reserve and KV
    for every row's request (a 512-token prompt, max_new_tokens on each of its N rows) fit the free memory."""
    from hsmc.engine.kv_sizing import AUTO_ROWS, MARGIN, PROMPT_TOKENS, _sizes, with_rows
    from hsmc.engine.scheduler import rows_and_lookahead
    from hsmc.models.shapes import random_shape
    from hsmc.preflight import _meta_module

    levels = [
        {"model": "random:qwen3-0.6b", "temperature": 1.0},
        {"kind": "smc", "model": "random:qwen3-0.6b", "temperature": 1.0, "particles": 8, "block_size": 8},
    ]
    assert random_shape(levels[0]["model"]) is not None
    cfg = load_config({"levels": levels, "engine": {"device": "cuda", "cuda_graphs": False}})
    assert cfg.engine.resolved_max_batch_rows == "auto"
    modules = [_meta_module(lc) for lc in cfg.levels]
    group, lookahead = rows_and_lookahead(cfg)

    def needs(rows: int) -> float:
        per_token, reserve = _sizes(_with(cfg, rows), modules)
        request = PROMPT_TOKENS + group * (cfg.generation.max_new_tokens + lookahead)
        return (reserve + rows // group * request * sum(per_token)) / (1 - MARGIN)

    for rows in (AUTO_ROWS, 64, 8):
        assert with_rows(cfg, modules, int(needs(rows)) + 1).engine.max_batch_rows == rows
        if rows > 8:
            assert with_rows(cfg, modules, int(needs(rows)) - 1).engine.max_batch_rows == rows // 2
    assert with_rows(cfg, modules, 1).engine.max_batch_rows == group  # one request's rows at least
    cpu = load_config({"levels": levels})
    assert cpu.engine.resolved_max_batch_rows == 16 and with_rows(cpu, modules, 1).engine.max_batch_rows == 16
    fixed = load_config({"levels": levels, "engine": {"device": "cuda", "max_batch_rows": 24}})
    assert with_rows(fixed, modules, 1).engine.max_batch_rows == 24


def _with(cfg, rows: int):
    import dataclasses

    return dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, max_batch_rows=rows))
