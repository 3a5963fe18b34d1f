"""`hsmc bench` pieces that run without a GPU: random models of real shapes, the transformers twin that
shares their weights, the refusal on a machine without CUDA, and what is timed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import TINY_CONFIGS
from helpers import make_runner, run_new_tokens

from hsmc import bench
from hsmc.bench import hf_twin
from hsmc.cli import main
from hsmc.models.config import DecoderConfig
from hsmc.models.shapes import SHAPES, hf_config, random_model
from hsmc.models.size import weight_bytes


@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
def test_transformers_twin_shares_the_weights_and_computes_the_same_logits(arch):
    from transformers import AutoConfig

    hf_cfg = AutoConfig.for_model(**TINY_CONFIGS[arch])
    model = random_model(DecoderConfig.from_hf(hf_cfg), torch.float32, "cpu", seed=3)
    twin = hf_twin(model, hf_cfg)
    storages = {q.untyped_storage().data_ptr() for q in model.parameters()}
    assert all(p.untyped_storage().data_ptr() in storages for p in twin.parameters()), "the twin copied a weight"
    ids = torch.randint(0, 80, (1, 9), generator=torch.Generator().manual_seed(0))
    (logits,), _ = run_new_tokens(make_runner(model), [0], [ids[0].tolist()])
    with torch.no_grad():
        ref = twin(ids).logits[0]
    assert (logits - ref).abs().max() < 1e-4


def test_named_shapes_have_the_published_parameter_counts():
    expected = {"qwen3-0.6b": 0.596e9, "qwen3-8b": 8.19e9, "qwen3-32b": 32.76e9, "llama-3.1-8b": 8.03e9}
    for name, count in expected.items():
        cfg = DecoderConfig.from_hf(hf_config(name))
        with torch.device("meta"):
            from hsmc.models.decoder import DecoderLM

            model = DecoderLM(cfg)
        assert weight_bytes(model) / 4 == pytest.approx(count, rel=0.01), name  # fp32 on meta: 4 bytes each
    assert set(expected) <= set(SHAPES)


def test_random_weights_are_not_zeros_and_norms_are_one():
    model = random_model(DecoderConfig.from_hf(hf_config("qwen3-0.6b")), torch.bfloat16, "cpu")
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.float().std().item() == pytest.approx(0.02, rel=0.05)
    assert torch.equal(layer.input_layernorm.weight, torch.ones_like(layer.input_layernorm.weight))
    assert model.lm_head.weight is model.model.embed_tokens.weight  # qwen3-0.6b ties them


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_bench_without_a_gpu_is_one_clear_error(capsys):
    assert main(["bench", "--shape", "qwen3-8b"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hsmc: error:") and "CUDA" in err[0]


def test_random_fp8_model_has_the_qwen_fp8_layout_and_its_bytes():
    from transformers import AutoConfig

    from hsmc.ops.fp8_linear import FP8_DTYPE, Fp8Linear

    shape = dict(hidden_size=256, intermediate_size=384, num_attention_heads=2, head_dim=128, num_hidden_layers=2)
    cfg = DecoderConfig.from_hf(AutoConfig.for_model(**{**TINY_CONFIGS["qwen2"], **shape}))  # qwen2: q/k/v biases
    dense = random_model(cfg, torch.bfloat16, "cpu")
    fp8 = random_model(cfg, torch.bfloat16, "cpu", fp8=True)
    linears = [m for m in fp8.modules() if isinstance(m, Fp8Linear)]
    assert len(linears) == 8 and all(m.weight.dtype == FP8_DTYPE for m in linears)
    assert fp8.model.layers[0].self_attn.qkv_proj.bias.dtype == torch.bfloat16
    layer_params = sum(m.weight.numel() for m in linears)
    scales = sum(m.weight_scale_inv.numel() for m in linears)
    assert weight_bytes(dense) - weight_bytes(fp8) == layer_params - 4 * scales  # 2 -> 1 byte, plus fp32 scales
    assert linears[0].dequantized(torch.float32).std().item() == pytest.approx(0.02, rel=0.05)


def test_fp8_table_rows_carry_their_speed_up_over_bf16():
    from hsmc.bench import BenchRow, format_table

    fp8 = BenchRow("qwen3-32b fp8", 1, 256, 90.0, 80.0, None, 100.0, [], vs_bf16=90.0 / 50.0)
    bf16 = BenchRow("qwen3-32b bfloat16", 1, 256, 50.0, 45.0, 40.0, 55.0, [])
    lines = format_table([fp8, bf16], "GPU", 3.3e12).splitlines()
    assert lines[2].split()[-1] == "1.80x" and "90.0%" in lines[2]  # 90 of a 100 tok/s FP8 roofline
    assert lines[3].split()[-1] == "-" and "1.25x" in lines[3]  # bf16 row: its transformers ratio, no fp8 ratio


def test_bench_times_no_run_length_it_has_not_run_before(monkeypatch):
    """A first run compiles the kernels its shapes need, so timing one measures the compiler: on an H200 the first
    1-token run at 72 rows compiled 15 Triton kernels the 16-token warm-up had not (10 s), and the decode time (the
    N-token run minus the 1-token run) came out negative."""
    lengths: list[int] = []
    timed_runs: list[tuple[int, list[int]]] = []  # (the timed run's length, the lengths run before it)

    class Decoder:
        def generate(self, ids: list, max_new_tokens: int, ignore_eos: bool) -> list:
            lengths.append(max_new_tokens)
            return [SimpleNamespace(stats={"levels": []})]

    def timed(fn, device=None) -> float:
        before = len(lengths)
        fn()
        timed_runs.append((lengths[before], lengths[:before]))
        return float(len(timed_runs))  # the N-token run (timed second) takes longer than the 1-token run

    monkeypatch.setattr(bench, "timed", timed)
    top = torch.nn.Linear(2, 2)
    top.config = SimpleNamespace(vocab_size=10)
    bench.bench_decoder("case", Decoder(), top, None, [1, 72], prompt_tokens=4, new_tokens=64, bandwidth=1e12)
    assert [length for length, _ in timed_runs] == [1, 64, 1, 64]
    for length, before in timed_runs:
        assert length in before
