"""Block-scaled FP8 compiled on the GPU: the Triton activation quantizer bit-equal to its torch definition, the
weight-only and FP8-activation GEMMs against the product of their quantized operands on the Qwen3-32B's Linears, an
FP8 model's logits against its dense twins, and the headline stack's shapes (FP8 32B + FP8 8B + an EAGLE3 head)
decoding within an H100's 80 GB. tests/test_fp8.py checks the same definitions on tiny shapes, interpreted."""

from __future__ import annotations

import gc
import json

import pytest
import torch
from test_eagle_checkpoint import published_layout
from test_fp8 import reference_groups

from hsmc.ops import flashinfer_gemm, fused
from hsmc.ops.flashinfer_gemm import flashinfer_block_scaled_matmul
from hsmc.ops.fp8_gemm import block_scaled_gemm, quantize_groups, rms_norm_quantize, silu_mul_quantize, w8a8_gemm
from hsmc.ops.fp8_linear import QWEN_BLOCK, Fp8Linear, dequantize_fp8, quantize_activations, quantize_fp8
from hsmc.ops.linear_router import Kernel, Route
from hsmc.ops.triton_backend import TritonBackend, run_route

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

LINEARS_32B = {"qkv": (10240, 5120), "o": (5120, 8192), "gate_up": (51200, 5120), "down": (5120, 25600)}
H100_BYTES = 79 * 2**30  # what an H100 80 GB leaves to a process


def test_quantize_groups_is_bit_equal_to_its_definition():
    """Rows whose magnitudes span 1e-4..1e3 (every binade of e4m3's scale), 200 groups of 128 per row: the same
    scales and the same e4m3 codes as the torch definition (`quantize_activations`' rounding)."""
    gen = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(64, 25600, device="cuda", generator=gen) * torch.logspace(-4, 3, 64, device="cuda")[:, None]
    x = x.bfloat16()
    q, scale = quantize_groups(x, 128)
    want_q, want_scale = reference_groups(x.float(), 128)
    assert torch.equal(scale, want_scale)
    assert torch.equal(q.float(), want_q.float())


@pytest.mark.parametrize(
    "prologue, k", [("norm", 4096), ("norm", 5120), ("norm", 8192), ("silu", 12288), ("silu", 25600)]
)
def test_fused_quantizers_are_bit_equal_to_their_prologue_then_quantize_groups(prologue, k):
    """Compiled, at the Qwen3 hidden and intermediate sizes: `rms_norm_quantize` sums each row's squares in
    `fused.rms_norm`'s order (the same block, warps and load vectors), and both give the e4m3 codes and scales of
    the prologue's bf16 rows quantized by `quantize_groups`; 144 rows padded to 160, scales column-major."""
    gen = torch.Generator("cuda").manual_seed(k)
    width = 2 * k if prologue == "silu" else k
    x = torch.randn(144, width, device="cuda", generator=gen) * torch.logspace(-3, 1, 144, device="cuda")[:, None]
    x = x.bfloat16()
    if prologue == "norm":
        weight = (torch.rand(k, device="cuda", generator=gen) + 0.5).bfloat16()
        q, scale = rms_norm_quantize(x, weight, 1e-6, 128, 160, column_major_scales=True)
        h = fused.rms_norm(x, weight, 1e-6)
    else:
        q, scale = silu_mul_quantize(x, 128, 160, column_major_scales=True)
        h = fused.silu_mul(x)
    want_q, want_scale = quantize_groups(h, 128, 160, column_major_scales=True)
    assert scale.stride() == want_scale.stride() == (1, 160)
    assert torch.equal(q[:144].view(torch.uint8), want_q[:144].view(torch.uint8))
    assert torch.equal(scale[:144], want_scale[:144])


@pytest.fixture(scope="module", params=list(LINEARS_32B))
def linear_32b(request) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One of the 32B's Linears in FP8 (e4m3 + a scale per 128 x 128 block) and its exact fp32 dequantization."""
    n, k = LINEARS_32B[request.param]
    gen = torch.Generator("cuda").manual_seed(n + k)
    w, s = quantize_fp8(torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) / k**0.5, QWEN_BLOCK)
    return w, s, dequantize_fp8(w, s, QWEN_BLOCK, torch.float32)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).norm() / want.norm()).item()


# Both sides below are bf16 roundings of the same fp32 product (the tensor cores' partial sums aside): the relative
# distance is that of two roundings, measured 1.8e-3..2.5e-3 on an H200 at every shape and row count. A wrong scale
# block, tile edge or K split is off by O(1).
ROUNDING = 5e-3


@pytest.mark.parametrize("rows", [1, 2, 16, 144, 256])
def test_weight_only_fp8_gemm_equals_the_dequantized_product(linear_32b, rows):
    w, s, dense = linear_32b
    x = torch.randn(rows, w.shape[1], device="cuda", dtype=torch.bfloat16)
    residual = torch.randn(rows, w.shape[0], device="cuda", dtype=torch.bfloat16)
    got = TritonBackend().linear(x, Fp8Linear.of(w, s, QWEN_BLOCK), residual.clone())
    assert relative_error(got, x.float() @ dense.T + residual.float()) < ROUNDING


@pytest.mark.parametrize("rows", [2, 16, 72, 144, 256, 1152])
def test_fp8_activation_gemm_equals_the_product_of_quantized_operands(linear_32b, rows):
    """`engine.fp8_activations`: rows quantized per 128 columns (the Triton quantizer), then the block-scaled FP8
    GEMM; its reference is the fp32 product of the dequantized operands. 1152 rows: an SMC verify of 16 requests
    (N = 8, K = 8)."""
    w, s, dense = linear_32b
    x = torch.randn(rows, w.shape[1], device="cuda", dtype=torch.bfloat16)
    got = TritonBackend().linear(x, Fp8Linear.of(w, s, QWEN_BLOCK, dynamic_activations=True))
    want = quantize_activations(x.float(), 128) @ dense.T
    assert relative_error(got, want) < ROUNDING
    assert relative_error(got, x.float() @ dense.T) > ROUNDING  # quantized (measured 1.2e-2..2.6e-2 off the bf16 input)


def needs_flashinfer() -> None:
    if torch.cuda.get_device_capability() != flashinfer_gemm.CAPABILITY:
        pytest.skip("flashinfer's block-scaled FP8 GEMM runs on Hopper (compute capability 9.0)")
    if flashinfer_gemm.installed_version() is None:
        pytest.skip('flashinfer is not installed (pip install "hsmc[flashinfer]")')


@pytest.mark.parametrize("rows", [2, 8, 72, 126, 144, 1152])
def test_flashinfer_fp8_gemm_equals_the_product_of_quantized_operands(linear_32b, rows):
    """The flashinfer route on the 32B's Linears (rows padded to 4, scales column-major): the fp32 product of the
    dequantized operands within two roundings, eagerly and replayed from a CUDA graph (the same bits)."""
    needs_flashinfer()
    w, s, dense = linear_32b
    x = torch.randn(rows, w.shape[1], device="cuda", dtype=torch.bfloat16)
    linear = Fp8Linear.of(w, s, QWEN_BLOCK, dynamic_activations=True)
    route = Route(Kernel.FP8_ACT_FLASHINFER, -(-rows // 4) * 4)
    got = run_route(route, x, linear)
    assert got.shape == (rows, w.shape[0])
    assert relative_error(got, quantize_activations(x.float(), 128) @ dense.T) < ROUNDING
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = run_route(route, x, linear)
    replayed.zero_()
    graph.replay()
    assert torch.equal(replayed, got)


def test_flashinfer_fp8_gemm_refuses_scales_cublaslt_would_not_read():
    needs_flashinfer()
    w, s = quantize_fp8(torch.randn(256, 512, device="cuda", dtype=torch.bfloat16), QWEN_BLOCK)
    x = torch.randn(6, 512, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="rows padded to 4 and column-major scales"):
        flashinfer_block_scaled_matmul(*quantize_groups(x, 128), w, s, 6)


PROLOGUES_32B = {"qkv": "norm", "o": None, "gate_up": "norm", "down": "silu"}  # o and down add the residual
FP8_ACT_KERNELS = {
    "triton": Kernel.FP8_ACT_TRITON,
    "cublaslt": Kernel.FP8_ACT_CUBLASLT,
    "flashinfer": Kernel.FP8_ACT_FLASHINFER,
}


@pytest.mark.parametrize("kernel", list(FP8_ACT_KERNELS.values()), ids=list(FP8_ACT_KERNELS))
@pytest.mark.parametrize("rows", [2, 144, 1152])
def test_fp8_activation_routes_with_a_fused_prologue_give_the_unfused_bits(linear_32b, kernel, rows):
    """Each FP8-activation route on the 32B's Linears, its quantizer in the RMSNorm / SiLU·mul kernel, against
    the kernels it replaces (the prologue writing bf16 rows, `quantize_groups`, the same GEMM): equal bits.
    cuBLASLt runs 16-row multiples (every row multiple it accepts divides 16), flashinfer multiples of 4."""
    if kernel is Kernel.FP8_ACT_CUBLASLT and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("cuBLASLt's block-scaled FP8 GEMM needs compute capability 9.0 or newer")
    if kernel is Kernel.FP8_ACT_FLASHINFER:
        needs_flashinfer()
    w, s, _ = linear_32b
    n, k = w.shape
    prologue = PROLOGUES_32B[next(name for name, shape in LINEARS_32B.items() if shape == (n, k))]
    gen = torch.Generator("cuda").manual_seed(rows)
    x = torch.randn(rows, 2 * k if prologue == "silu" else k, device="cuda", generator=gen).bfloat16()
    norm = ((torch.rand(k, device="cuda", generator=gen) + 0.5).bfloat16(), 1e-6) if prologue == "norm" else None
    residual = None if norm else torch.randn(rows, n, device="cuda", generator=gen).bfloat16()
    linear = Fp8Linear.of(w, s, QWEN_BLOCK, dynamic_activations=True)
    multiple = {Kernel.FP8_ACT_CUBLASLT: 16, Kernel.FP8_ACT_FLASHINFER: 4}.get(kernel, 1)
    route = Route(kernel, -(-rows // multiple) * multiple)
    got = run_route(route, x, linear, norm=norm, silu_mul=prologue == "silu", residual=residual)
    h = fused.rms_norm(x, *norm) if norm else fused.silu_mul(x) if prologue == "silu" else x
    if kernel is Kernel.FP8_ACT_TRITON:
        want = w8a8_gemm(h, w, s, QWEN_BLOCK, residual=residual)
    elif kernel is Kernel.FP8_ACT_FLASHINFER:
        q, q_scale = quantize_groups(h, 128, route.run_rows, column_major_scales=True)
        want = flashinfer_block_scaled_matmul(q, q_scale, w, s, rows)
        want = want if residual is None else residual + want
    else:
        want = block_scaled_gemm(h, w, s, route.run_rows)
        want = want if residual is None else residual + want
    assert torch.equal(got, want)


@pytest.fixture
def h100_memory(monkeypatch):
    """On a GPU larger than an H100 80 GB, allocations and `kv_capacity_tokens: auto` held to an H100's memory."""
    import hsmc.levels.stack

    gc.collect()  # the earlier tests' models and graphs (runners and graphs reference each other)
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    if total > H100_BYTES + 2**30:
        real_free = hsmc.levels.stack.free_memory
        torch.cuda.set_per_process_memory_fraction(H100_BYTES / total)
        monkeypatch.setattr(
            hsmc.levels.stack, "free_memory", lambda d: min(real_free(d), H100_BYTES - torch.cuda.memory_reserved(d))
        )
    yield
    torch.cuda.set_per_process_memory_fraction(1.0)
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("fp8_activations", [False, True], ids=["weight-only", "fp8-activations"])
def test_headline_stack_shapes_in_fp8_decode_within_an_h100(h100_memory, tmp_path, fp8_activations):
    """configs/qwen3_32b.yaml's stack on random weights of the real shapes: FP8 32B (SMC, N = 6, K = 16) over FP8 8B
    (rejection) over an EAGLE3 head, KV auto-sized, 48 rows: two requests decode every token they ask for, and the
    peak allocation (weights, KV, cycle graphs, activations) stays within an H100's 80 GB."""
    from hsmc.config import load_config
    from hsmc.decoder import HierarchicalDecoder
    from hsmc.models.config import DecoderConfig
    from hsmc.models.loading import LoadedModel
    from hsmc.models.shapes import hf_config, random_model

    torch.cuda.reset_peak_memory_stats()
    big = random_model(DecoderConfig.from_hf(hf_config("qwen3-32b")), torch.bfloat16, "cuda", seed=1, fp8=True)
    c = hf_config("qwen3-8b")
    small = random_model(DecoderConfig.from_hf(c), torch.bfloat16, "cuda", seed=2, fp8=True)
    sizes = (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size,
             c.vocab_size, 32000)  # fmt: skip
    head, _ = published_layout(tmp_path / "head", dtype=torch.bfloat16, sizes=sizes, scale=0.02)
    head_config = json.loads((head / "config.json").read_text())  # a published head's context is its verifier's
    head_config["max_position_embeddings"] = c.max_position_embeddings
    (head / "config.json").write_text(json.dumps(head_config))
    config = load_config({
        "levels": [
            {"kind": "eagle3", "model": str(head), "dtype": "bfloat16", "temperature": 0.6},
            {"kind": "rejection", "model": "8b", "dtype": "bfloat16", "temperature": 0.6, "num_draft_tokens": 4},
            {"kind": "smc", "model": "32b", "dtype": "bfloat16", "temperature": 0.6, "particles": 6, "block_size": 16},
        ],
        "engine": {"device": "cuda", "max_batch_rows": 48, "kv_capacity_tokens": "auto",
                   "fp8_activations": fp8_activations},
        "generation": {"max_new_tokens": 64, "ignore_eos": True},
    })  # fmt: skip
    models = {"32b": LoadedModel(big, None, "32b"), "8b": LoadedModel(small, None, "8b")}
    decoder = HierarchicalDecoder(config, models)
    prompts = torch.randint(0, 1000, (2, 128), generator=torch.Generator().manual_seed(0)).tolist()
    decoder.generate(prompts, max_new_tokens=8)  # compiles the kernels and captures the graphs
    results = decoder.generate(prompts)
    assert [len(r.token_ids) for r in results] == [64, 64]
    assert torch.cuda.max_memory_allocated() < H100_BYTES
