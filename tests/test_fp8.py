"""Block-scaled FP8 weights: quantization, the Triton weight-only GEMM (through Triton's interpreter on the
CPU), FP8 models against a reference on the dequantized weights, and checkpoints in Qwen's FP8 layout."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny_model
from helpers import make_runner, run_new_tokens

pytest.importorskip("triton")

from hsmc.config import load_config  # noqa: E402
from hsmc.decoder import HierarchicalDecoder  # noqa: E402
from hsmc.errors import (
    ConfigError,  # noqa: E402
    ModelLoadError,  # noqa: E402
)
from hsmc.models.loading import LoadedModel, load_model, read_decoder_config, safetensors_files  # noqa: E402
from hsmc.models.weight_loader import load_decoder  # noqa: E402
from hsmc.ops import fused  # noqa: E402
from hsmc.ops.fp8_gemm import (  # noqa: E402
    Fp8GemmPlan,
    W8A8Plan,
    block_scaled_gemm,
    fp8_gemm,
    quantize_groups,
    rms_norm_quantize,
    silu_mul_quantize,
    w8a8_gemm,
    w8a8_matmul,
)
from hsmc.ops.fp8_linear import (  # noqa: E402
    FP8_DTYPE,
    FP8_MAX,
    Fp8Linear,
    dequantize_fp8,
    quantize_activations,
    quantize_fp8,
)
from hsmc.ops.linear_router import Kernel, Route  # noqa: E402
from hsmc.ops.triton_backend import run_route  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = [[5, 17, 3, 40], [7, 7, 60]]


def test_quantize_maps_each_block_max_to_448_and_round_trips_within_e4m3_precision():
    torch.manual_seed(0)
    w = torch.randn(40, 70) * torch.logspace(-3, 1, 40)[:, None]  # rows of very different scales
    q, scale = quantize_fp8(w, (16, 32))
    assert q.dtype == FP8_DTYPE and scale.shape == (3, 3)
    assert q.float().abs().amax(dim=1).reshape(-1)[:32].eq(FP8_MAX).view(2, 16).any(dim=1).all()
    back = dequantize_fp8(q, scale, (16, 32), torch.float32)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 for normals, plus the subnormal step near 0
    block_max = scale.repeat_interleave(16, 0)[:40].repeat_interleave(32, 1)[:, :70] * FP8_MAX
    assert ((back - w).abs() <= w.abs() / 16 + block_max * 2**-9 / FP8_MAX * 2).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize(
    "m,n,k,block,split",
    [(1, 40, 72, (16, 32), 1), (1, 64, 200, (32, 32), 3), (5, 33, 96, (16, 16), 2), (20, 48, 50, (16, 16), 1)],
    ids=["one-row", "one-row-splitk-raggedK", "verify-splitk", "rows-raggedN"],
)
@pytest.mark.parametrize("residual", [False, True], ids=["", "residual"])
def test_triton_fp8_gemm_equals_dequantized_matmul(m, n, k, block, split, dtype, residual):
    torch.manual_seed(m + n + k)
    w, scale = quantize_fp8(torch.randn(n, k), block)
    x = torch.randn(m, k).to(dtype)
    res = torch.randn(m, n).to(dtype) if residual else None
    plan = Fp8GemmPlan(block_m=16, block_n=16, block_k=min(block[1], 32), split_k=split, num_stages=1)
    out = fp8_gemm(x.to(DEVICE), w.to(DEVICE), scale.to(DEVICE), block, plan, None if res is None else res.to(DEVICE))
    ref = x.float() @ dequantize_fp8(w, scale, block, torch.float32).T + (0 if res is None else res.float())
    assert out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.cpu().float(), ref, atol=tol * ref.abs().max().item(), rtol=tol)


@pytest.mark.parametrize("m", [1, 3])
def test_default_plans_equal_dequantized_matmul(m):
    """The planner's own tiles over a Qwen-sized scale block, ragged K."""
    torch.manual_seed(m)
    w, scale = quantize_fp8(torch.randn(24, 600), (128, 128))
    x = torch.randn(m, 600)
    out = fp8_gemm(x.to(DEVICE), w.to(DEVICE), scale.to(DEVICE), (128, 128)).cpu()
    ref = x @ dequantize_fp8(w, scale, (128, 128), torch.float32).T
    torch.testing.assert_close(out, ref, atol=1e-5 * ref.abs().max().item(), rtol=1e-5)


def reference_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as e4m3 values and one fp32 scale per row and group (torch ops, the kernel's definition)."""
    m, k = x.shape
    padded = torch.nn.functional.pad(x.float(), (0, -k % group)).view(m, -1, group)
    scale = (padded.abs().amax(-1) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    return (padded / scale[..., None]).to(FP8_DTYPE).flatten(1)[:, :k], scale


def test_quantized_activations_keep_each_block_max_and_e4m3_precision():
    torch.manual_seed(0)
    x = torch.randn(5, 300) * torch.logspace(-3, 2, 5)[:, None]
    x[2, 128:256] = 0  # an all-zero block stays zero
    got = quantize_activations(x, 128)
    blocks = torch.nn.functional.pad(x, (0, 84)).view(5, 3, 128).abs().amax(-1)
    got_blocks = torch.nn.functional.pad(got, (0, 84)).view(5, 3, 128).abs().amax(-1)
    torch.testing.assert_close(got_blocks, blocks, rtol=1e-6, atol=0)  # 448 * scale is the block's max again
    assert torch.equal(got[2, 128:256], x[2, 128:256])
    # e4m3: 3 mantissa bits (relative error <= 2^-4), subnormal steps of 2^-9 * scale near zero
    step = blocks.repeat_interleave(128, 1)[:, :300] / FP8_MAX * 2**-9
    assert ((got - x).abs() <= x.abs() / 16 + step).all()
    q, scale = reference_groups(x, 128)
    assert torch.equal(got, (q.float().view(5, -1) * scale.repeat_interleave(128, 1)[:, :300]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize(
    "m,plan",
    [
        (1, W8A8Plan(16, 16)),
        (5, W8A8Plan(16, 32, split_k=3)),
        (37, W8A8Plan(32, 64, num_stages=2)),
        (37, W8A8Plan(16, 32, split_k=2, swap_ab=False)),
        (5, W8A8Plan(32, 16, swap_ab=False)),
    ],
    ids=["one-row", "splitk-straddling-scale-rows", "row-tiles", "unswapped-row-tiles-splitk", "unswapped"],
)
@pytest.mark.parametrize("residual", [False, True], ids=["", "residual"])
def test_w8a8_matmul_equals_the_product_of_quantized_operands(m, plan, dtype, residual):
    """FP8 activations x FP8 weights on the tensor cores: each K tile scaled by the row's and the weight block's
    scale; ragged N and K, program tiles straddling weight scale rows, several programs per weight tile."""
    torch.manual_seed(m)
    n, k, block = 72, 200, (16, 32)
    w, scale = quantize_fp8(torch.randn(n, k) * torch.logspace(-1, 1, n)[:, None], block)
    x = torch.randn(m, k)
    res = torch.randn(m, n).to(dtype) if residual else None
    q, q_scale = reference_groups(x, block[1])
    out = w8a8_matmul(q.to(DEVICE), q_scale.to(DEVICE), w.to(DEVICE), scale.to(DEVICE), block, dtype, plan,
                      None if res is None else res.to(DEVICE)).cpu()  # fmt: skip
    ref = quantize_activations(x, block[1]) @ dequantize_fp8(w, scale, block, torch.float32).T
    ref = ref.to(dtype).float() + (0 if res is None else res.float())
    assert out.dtype == dtype
    # Hopper's FP8 tensor cores add products into fewer than fp32's 24 bits (measured 7e-5 of the largest output
    # on an H200); the interpreter's dot is exact
    tol = 2e-3 if dtype != torch.float32 else (1e-5 if DEVICE == "cpu" else 2e-4)
    torch.testing.assert_close(out.float(), ref, atol=tol * ref.abs().max().item(), rtol=tol)


@pytest.mark.skipif(DEVICE == "cpu", reason="Triton's interpreter rounds some fp32 values to e4m3 one binade low")
def test_quantize_groups_kernel_equals_reference():
    torch.manual_seed(0)
    x = (torch.randn(7, 1000) * torch.logspace(-4, 3, 7)[:, None]).to(DEVICE, torch.bfloat16)
    q, scale = quantize_groups(x, 128)
    q_ref, scale_ref = reference_groups(x.float(), 128)
    assert torch.equal(scale, scale_ref) and torch.equal(q.float(), q_ref.float())


def test_quantize_groups_writes_column_major_scales_and_taller_outputs_with_the_same_values():
    """The layout cuBLASLt's block-scaled GEMM reads: scales [rows, K/128] with strides (1, rows), both outputs
    `rows` tall (the extra rows unset, never read); the first M rows hold what the row-major call writes."""
    torch.manual_seed(0)
    x = (torch.randn(5, 300) * torch.logspace(-2, 2, 5)[:, None]).to(DEVICE)
    q, scale = quantize_groups(x, 128)
    q_cm, scale_cm = quantize_groups(x, 128, rows=16, column_major_scales=True)
    assert q_cm.shape == (16, 300) and q_cm.is_contiguous()
    assert scale_cm.shape == (16, 3) and scale_cm.stride() == (1, 16)
    assert torch.equal(q_cm[:5].float(), q.float()) and torch.equal(scale_cm[:5], scale)
    assert scale.shape == (5, 3) and scale.is_contiguous()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("prologue", ["norm", "silu"])
@pytest.mark.parametrize(
    "k,group,rows,column_major",
    [(300, 64, None, False), (300, 64, 8, True), (96, 32, None, True), (40, 64, 6, False)],
    ids=["raggedK", "taller-column-major", "whole-groups-column-major", "K-below-group-taller"],
)
def test_fused_quantizers_equal_their_prologue_then_quantize_groups(prologue, dtype, k, group, rows, column_major):
    """`rms_norm_quantize` / `silu_mul_quantize`: the bits of the prologue's kernel then `quantize_groups` (e4m3 codes,
    scales, layout), an all-zero row and an all-zero group among them; the scales also against their torch
    definition, which the quantizing code the three kernels share cannot follow into an error."""
    torch.manual_seed(k + group)
    m = 5
    x = torch.randn(m, k) * torch.logspace(-2, 1, m)[:, None]
    x[1] = 0
    if prologue == "norm":
        weight = torch.rand(k) + 0.5
        weight[group : 2 * group] = 0  # the second group (none where K <= group)
        x, weight = x.to(dtype), weight.to(dtype)
        h = fused.rms_norm(x, weight, 1e-6)
        q, scale = rms_norm_quantize(x, weight, 1e-6, group, rows, column_major)
    else:
        up = torch.randn(m, k)
        up[:, group : 2 * group] = 0
        gate_up = torch.cat([x, up], 1).to(dtype)
        h = fused.silu_mul(gate_up)
        q, scale = silu_mul_quantize(gate_up, group, rows, column_major)
    want_q, want_scale = quantize_groups(h, group, rows, column_major)
    assert q.shape == want_q.shape and q.dtype == FP8_DTYPE
    assert scale.shape == want_scale.shape and scale.stride() == want_scale.stride()
    assert torch.equal(q[:m].view(torch.uint8), want_q[:m].view(torch.uint8))
    assert torch.equal(scale[:m], want_scale[:m])
    assert torch.equal(scale[:m], reference_groups(h.float(), group)[1])
    tiny = torch.finfo(torch.float32).tiny  # the scale of an all-zero group
    assert (scale[1] == tiny).all() and (scale[:m, 1:2] == tiny).all()
    assert (q[1].float() == 0).all() and (q[:m, group : 2 * group].float() == 0).all()


def unfused_fp8_activation_linear(
    kernel: Kernel, x: torch.Tensor, linear: Fp8Linear, norm, silu_mul: bool, residual, run_rows: int
) -> torch.Tensor:
    """What `run_route` ran on the FP8-activation routes before the quantizer joined the prologue: the prologue's
    kernel writing bf16 rows, `w8a8_gemm` / `block_scaled_gemm` on them, then the bias and the residual."""
    k = linear.weight.shape[1]
    h = fused.rms_norm(x, *norm) if norm is not None else fused.silu_mul(x) if silu_mul else x
    h = h.reshape(-1, k)
    weight, scale, block, bias = linear.weight, linear.weight_scale_inv, linear.block, linear.bias
    res = residual.reshape(h.shape[0], -1) if residual is not None else None
    if kernel is Kernel.FP8_ACT_TRITON:
        if bias is None:
            return w8a8_gemm(h, weight, scale, block, residual=res)
        out = w8a8_gemm(h, weight, scale, block) + bias
    else:
        out = block_scaled_gemm(h, weight, scale, run_rows)
        out = out + bias if bias is not None else out
    return out if res is None else res + out


def fp8_activation_case(prologue: str, bias: bool, residual: bool, k: int, n: int, block: tuple[int, int]):
    """A dynamic-activation FP8 Linear, inputs [3, 2, K] (SiLU·mul: [3, 2, 2K]), the norm and residual if asked."""
    torch.manual_seed(k + n + 2 * bias + residual)
    linear = Fp8Linear(k, n, bias, block, bias_dtype=torch.bfloat16)
    linear.weight.data, linear.weight_scale_inv.data = quantize_fp8(torch.randn(n, k) / k**0.5, block)
    if bias:
        linear.bias.data = torch.randn(n).bfloat16()
    linear.dynamic_activations = True
    x = torch.randn(3, 2, 2 * k if prologue == "silu" else k).bfloat16()
    norm = ((torch.rand(k) + 0.5).bfloat16(), 1e-6) if prologue == "norm" else None
    res = torch.randn(3, 2, n).bfloat16() if residual else None
    return linear, x, norm, res


@pytest.mark.parametrize("prologue", ["norm", "silu", "none"])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("residual", [False, True], ids=["", "residual"])
def test_triton_fp8_activation_route_quantizes_in_its_prologue_bit_for_bit(prologue, bias, residual):
    """`run_route` on FP8_ACT_TRITON with an RMSNorm / SiLU·mul (or no) prologue: the bits of the unfused chain,
    the residual added in the kernel without a bias and after it with one."""
    linear, x, norm, res = fp8_activation_case(prologue, bias, residual, 200, 72, (16, 32))
    route = Route(Kernel.FP8_ACT_TRITON, 6)
    got = run_route(route, x, linear, norm=norm, silu_mul=prologue == "silu", residual=res)
    want = unfused_fp8_activation_linear(route.kernel, x, linear, norm, prologue == "silu", res, 6)
    assert got.shape == (3, 2, 72) and got.dtype == torch.bfloat16
    assert torch.equal(got.view(-1, 72), want)


@pytest.mark.parametrize("prologue", ["norm", "silu", "none"])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("residual", [False, True], ids=["", "residual"])
def test_cublaslt_fp8_activation_route_hands_its_gemm_the_unfused_operands(monkeypatch, prologue, bias, residual):
    """FP8_ACT_CUBLASLT without CUDA: cuBLASLt's GEMM (`block_scaled_matmul`) replaced by the fp32 product of its
    dequantized operands, which checks the layout it is handed (`run_rows` tall, column-major scales); the route
    with its prologue fused gives the unfused chain's bits (tests/gpu/test_fp8_on_cuda.py runs cuBLASLt itself)."""

    def product(q, q_scale, weight, scale, dtype, rows):
        assert q.shape[0] == q_scale.shape[0] == 8 and q_scale.stride() == (1, 8)
        x = (q[:rows].float().view(rows, -1, 128) * q_scale[:rows, :, None]).flatten(1)
        return (x @ dequantize_fp8(weight, scale, (128, 128), torch.float32).T).to(dtype)

    monkeypatch.setattr("hsmc.ops.fp8_gemm.block_scaled_matmul", product)
    monkeypatch.setattr("hsmc.ops.triton_backend.block_scaled_matmul", product)
    linear, x, norm, res = fp8_activation_case(prologue, bias, residual, 256, 128, (128, 128))
    route = Route(Kernel.FP8_ACT_CUBLASLT, 8)
    got = run_route(route, x, linear, norm=norm, silu_mul=prologue == "silu", residual=res)
    want = unfused_fp8_activation_linear(route.kernel, x, linear, norm, prologue == "silu", res, 8)
    assert got.shape == (3, 2, 128) and torch.equal(got.view(-1, 128), want)


def test_fp8_activations_quantize_inputs_of_two_or_more_rows():
    """A dynamic-activation FP8 Linear: one row as weight-only, more rows on their quantized values (the CPU
    oracle of the FP8 GEMM: per row, so a row's output does not depend on the rows beside it)."""
    torch.manual_seed(1)
    module = Fp8Linear(256, 48, False, (16, 128))
    module.weight.data, module.weight_scale_inv.data = quantize_fp8(torch.randn(48, 256), (16, 128))
    dense = module.dequantized(torch.float32)
    x = torch.randn(3, 256)
    module.dynamic_activations = True
    one, many = module(x[:1]), module(x)
    torch.testing.assert_close(one, x[:1] @ dense.T)
    torch.testing.assert_close(many, quantize_activations(x, 128) @ dense.T)
    torch.testing.assert_close(many[1:], module(x[1:]))
    assert (many - x @ dense.T).abs().max() > 1e-3  # quantizing changed them


def test_engine_fp8_activations_reach_every_fp8_linear_and_need_one(tiny_qwen3):
    cfg = read_decoder_config(tiny_qwen3)
    fp8 = load_decoder(tiny_qwen3, safetensors_files(tiny_qwen3), cfg, torch.float32, "cpu", "tiny", None, (16, 16))
    config = {"levels": [{"model": "m"}], "engine": {"fp8_activations": True}}
    HierarchicalDecoder(load_config(config), models={"m": LoadedModel(fp8, None, "m")})
    assert all(m.dynamic_activations for m in fp8.modules() if isinstance(m, Fp8Linear))
    dense = load_model(str(tiny_qwen3), "float32").model
    with pytest.raises(ConfigError, match="engine.fp8_activations=true but no level's model has FP8 weights"):
        HierarchicalDecoder(load_config(config), models={"m": LoadedModel(dense, None, "m")})


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    return make_tiny_model("qwen3", tmp_path_factory.mktemp("qwen3"))


def dequantized_twin(fp8_model, dense_folder):
    """The dense fp32 model (of `dense_folder`'s shape) whose weights are exactly the FP8 model's, dequantized."""
    ref = load_model(str(dense_folder), "float32").model
    for name, module in fp8_model.named_modules():
        if isinstance(module, Fp8Linear):
            ref.get_submodule(name).weight.copy_(module.dequantized(torch.float32))
            continue
        for param, value in module.named_parameters(recurse=False):
            getattr(ref.get_submodule(name), param).copy_(value)
    return ref


def test_fp8_model_decodes_like_its_dequantized_reference(tiny_qwen3):
    cfg = read_decoder_config(tiny_qwen3)
    fp8 = load_decoder(tiny_qwen3, safetensors_files(tiny_qwen3), cfg, torch.float32, "cpu", "tiny", None, (16, 16))
    linears = [m for m in fp8.modules() if isinstance(m, Fp8Linear)]
    assert len(linears) == 4 * cfg.num_layers and all(m.weight.dtype == FP8_DTYPE for m in linears)
    assert not isinstance(fp8.lm_head, Fp8Linear)
    ref = dequantized_twin(fp8, tiny_qwen3)
    (a,), _ = run_new_tokens(make_runner(fp8), [0], [PROMPTS[0]])
    (b,), _ = run_new_tokens(make_runner(ref), [0], [PROMPTS[0]])
    assert torch.equal(a, b)
    outputs = []
    for model in (fp8, ref):
        config = load_config({"levels": [{"model": "m"}], "generation": {"max_new_tokens": 24, "ignore_eos": True}})
        decoder = HierarchicalDecoder(config, models={"m": LoadedModel(model, None, "m")})
        outputs.append([r.token_ids for r in decoder.generate(PROMPTS)])
    assert outputs[0] == outputs[1]


QWEN_FP8_SHAPE = dict(hidden_size=192, intermediate_size=256, num_attention_heads=2, head_dim=128, num_hidden_layers=2)


def write_qwen_fp8_checkpoint(dense_folder, folder, not_converted=()):
    """Qwen's FP8 release layout: config.json with quantization_config, every decoder-layer Linear (but the
    `not_converted` ones) as float8_e4m3fn `weight` + fp32 `weight_scale_inv` per 128x128 block, the rest
    bf16, two shards."""
    from safetensors.torch import load_file, save_file

    folder.mkdir()
    config = json.loads((dense_folder / "config.json").read_text())
    config["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
        "modules_to_not_convert": list(not_converted),
    }
    (folder / "config.json").write_text(json.dumps(config))
    state = {}
    for key, value in load_file(dense_folder / "model.safetensors").items():
        if ".layers." in key and key.endswith("proj.weight") and key.removesuffix(".weight") not in not_converted:
            state[key], state[key + "_scale_inv"] = quantize_fp8(value, (128, 128))
        else:
            state[key] = value.to(torch.bfloat16)
    keys = sorted(state)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for name, names in shards.items():
        save_file({k: state[k] for k in names}, folder / name)
    weight_map = {k: name for name, names in shards.items() for k in names}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return state


def test_qwen_fp8_checkpoint_loads_as_its_dequantized_model(tmp_path):
    dense = make_tiny_model("qwen3", tmp_path / "dense", **QWEN_FP8_SHAPE)
    state = write_qwen_fp8_checkpoint(dense, tmp_path / "fp8", not_converted=("model.layers.1.mlp.down_proj",))
    model = load_model(str(tmp_path / "fp8"), "float32").model
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Fp8Linear) and qkv.weight_scale_inv.shape == (6, 2)  # q, k, v: 256 rows each; K = 192
    assert not isinstance(model.model.layers[1].mlp.down_proj, Fp8Linear)  # left in bf16 by the checkpoint
    saved = model.state_dict()  # fused parts come back out under the checkpoint's names, scales included
    assert set(saved) == set(state)
    assert all(torch.equal(saved[k].float(), state[k].float()) for k in state if k.endswith("_scale_inv"))
    ref = dequantized_twin(model, dense)
    (a,), _ = run_new_tokens(make_runner(model), [0], [PROMPTS[0]])
    (b,), _ = run_new_tokens(make_runner(ref), [0], [PROMPTS[0]])
    assert torch.equal(a, b)


def test_fp8_errors_name_the_cause(tmp_path, tiny_qwen3):
    with pytest.raises(
        ModelLoadError, match="qkv_proj: q_proj has 64 output rows, not a multiple of the fp8 block 128"
    ):
        load_model(str(tiny_qwen3), "fp8")
    config = json.loads((tiny_qwen3 / "config.json").read_text())
    for quant, message in [
        ({"quant_method": "awq"}, "quant_method='awq' is not supported"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "weight_block_size=None: hsmc reads block-scaled"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}, "'static'"),
    ]:
        folder = tmp_path / quant["quant_method"] / str(len(quant))
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
        (folder / "model.safetensors").symlink_to(tiny_qwen3 / "model.safetensors")
        with pytest.raises(ModelLoadError, match=message):
            load_model(str(folder))


def test_fp8_hierarchical_stack_decodes_as_its_dequantized_twin(tmp_path):
    """The headline stack's kinds (an EAGLE3 head, FP8 rejection, FP8 SMC) on small random Qwen3-shaped models with
    Qwen's 128 x 128 blocks: a seeded T = 0.6 run gives the same tokens as the same stack on dense models holding
    the dequantized weights (on the CPU an FP8 Linear is the dequantized matmul). tests/gpu runs the real shapes."""
    from test_eagle_checkpoint import published_layout
    from transformers import AutoConfig

    from hsmc.models.config import DecoderConfig
    from hsmc.models.shapes import random_model

    shape = dict(model_type="qwen3", hidden_size=256, intermediate_size=384, num_hidden_layers=4, head_dim=128,
                 num_attention_heads=2, num_key_value_heads=1, vocab_size=512, max_position_embeddings=512)  # fmt: skip
    cfg = DecoderConfig.from_hf(AutoConfig.for_model(**shape))
    fp8 = {name: random_model(cfg, torch.float32, "cpu", seed=seed, fp8=True) for name, seed in (("8b", 2), ("32b", 1))}
    dense = {name: dequantized_twin_of(model) for name, model in fp8.items()}
    sizes = (256, 2, 1, 128, 384, 512, 128)
    head, _ = published_layout(tmp_path / "head", dtype=torch.float32, sizes=sizes, scale=0.05)
    config = load_config({
        "levels": [
            {"kind": "eagle3", "model": str(head), "temperature": 0.6},
            {"kind": "rejection", "model": "8b", "temperature": 0.6, "num_draft_tokens": 4},
            {"kind": "smc", "model": "32b", "temperature": 0.6, "particles": 3, "block_size": 4},
        ],
        "engine": {"kv_capacity_tokens": 2048},
        "generation": {"max_new_tokens": 12, "ignore_eos": True, "seed": 3},
    })  # fmt: skip
    outputs = []
    for models in (fp8, dense):
        decoder = HierarchicalDecoder(config, {name: LoadedModel(m, None, name) for name, m in models.items()})
        outputs.append([r.token_ids for r in decoder.generate(PROMPTS)])
    assert outputs[0] == outputs[1]
    assert all(len(tokens) == 12 for tokens in outputs[0])


def dequantized_twin_of(fp8_model):
    """A deep copy of `fp8_model` with every FP8 Linear replaced by a dense Linear of its dequantized fp32 weight."""
    import copy

    twin = copy.deepcopy(fp8_model)
    for name, module in list(twin.named_modules()):
        if isinstance(module, Fp8Linear):
            dense = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            dense.weight = torch.nn.Parameter(module.dequantized(torch.float32), requires_grad=False)
            dense.bias = module.bias
            owner, _, child = name.rpartition(".")
            twin.get_submodule(owner).add_module(child, dense)
    return twin
