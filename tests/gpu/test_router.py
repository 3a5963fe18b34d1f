"""The Linear router on the GPU: every route it picks for the Qwen3-8B / 32B Linears at the engine's row counts gives
the reference backend's result (bf16 weights, FP8 weights, FP8 activations), and a GPU with a packaged tuning file
routes with that file.

Tolerances, as a relative Frobenius error against `TorchBackend` on the same modules and inputs:
- bf16 and FP8 weights: 2^-7, one bf16 ulp. Both sides accumulate in fp32 and round the output (and the residual
  sum) to bf16 once, so an element differs by at most about one ulp; the FP8 reference also rounds its dequantized
  weight to bf16 (2^-9 relative per weight, averaging out over K).
- FP8 activations: 2^-6. Both quantize the same rows to e4m3 per 128 columns, but the fused RMSNorm / SiLU·mul
  before it may differ from the reference's in the last place of an exp, which can move an activation by one e4m3
  step (2^-4 of it) for a few entries; the FP8 tensor cores accumulate in fewer bits than fp32 (~1e-4).
A wrong scale layout, a lost residual or a dropped row is an O(1) error."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hsmc.models.decoder import RMSNorm
from hsmc.ops import flashinfer_gemm
from hsmc.ops.backend import TorchBackend
from hsmc.ops.fp8_linear import QWEN_BLOCK, Fp8Linear, quantize_fp8
from hsmc.ops.kernel_tuning import DEFAULTS, current_versions, packaged_tunings, tuning_for
from hsmc.ops.linear_router import Kernel, router_for
from hsmc.ops.triton_backend import TritonBackend
from hsmc.ops.tune_kernels import FP8_CAPABILITY, QWEN3_LINEARS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# the engine's row counts; 24: a 32-row few-row tile, 204 (two N = 6, K = 16 verifies): cuBLASLt's FP8 rows padded
ROWS = (1, 2, 8, 16, 24, 72, 128, 144, 204, 1152)
TOLERANCE = {"bf16": 2**-7, "fp8": 2**-7, "fp8-activations": 2**-6}
CASES = [
    (name, weights)
    for name in QWEN3_LINEARS
    for weights in TOLERANCE
    if weights == "bf16" or not name.endswith("lm_head")  # FP8 checkpoints keep the LM head in bf16
]


@pytest.fixture(scope="module")
def modules():
    """The Linear of each case on the GPU, random weights of the shape (built once)."""
    built: dict[tuple[str, str], nn.Module] = {}

    def get(name: str, weights: str) -> nn.Module:
        if (name, weights) not in built:
            n, k, _ = QWEN3_LINEARS[name]
            gen = torch.Generator(device="cuda").manual_seed(n + k)
            w = torch.randn(n, k, device="cuda", generator=gen) / k**0.5
            if weights == "bf16":
                module = nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16).requires_grad_(False)
                module.weight.copy_(w)
            else:
                module = Fp8Linear(k, n, False, QWEN_BLOCK).cuda()
                module.weight.data, module.weight_scale_inv.data = quantize_fp8(w, QWEN_BLOCK)
                module.dynamic_activations = weights == "fp8-activations"
            built[name, weights] = module
        return built[name, weights]

    return get


def run(backend, name: str, linear: nn.Module, inputs: dict) -> torch.Tensor:
    """The step the model runs this Linear in: after the norm (qkv, gate_up, LM head), with the residual (o) or
    after SiLU·mul with the residual (down)."""
    if QWEN3_LINEARS[name][2]:
        return backend.norm_linear(inputs["x"], inputs["norm"], linear)
    if name.endswith("down"):
        return backend.silu_linear(inputs["x"], linear, inputs["residual"].clone())
    return backend.linear(inputs["x"], linear, inputs["residual"].clone())


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("name, weights", CASES, ids=[f"{n.replace(' ', '-')}-{w}" for n, w in CASES])
def test_every_route_gives_the_reference_result(modules, name, weights, rows):
    if weights != "bf16" and torch.cuda.get_device_capability() < FP8_CAPABILITY:
        pytest.skip("FP8 kernels need compute capability 8.9 or newer")
    linear = modules(name, weights)
    n, k, norm_fed = QWEN3_LINEARS[name]
    gen = torch.Generator(device="cuda").manual_seed(rows)
    width = 2 * k if name.endswith("down") else k
    inputs = {"x": torch.randn(rows, 1, width, device="cuda", generator=gen).bfloat16()}
    if norm_fed:
        inputs["norm"] = RMSNorm(k, 1e-6).cuda().bfloat16()
        inputs["norm"].weight.data = (torch.rand(k, device="cuda", generator=gen) + 0.5).bfloat16()
    else:
        inputs["residual"] = torch.randn(rows, 1, n, device="cuda", generator=gen).bfloat16()
    route = router_for(inputs["x"].device).plan(inputs["x"].shape, linear, torch.bfloat16, norm_fed)
    with torch.no_grad():
        got = run(TritonBackend(), name, linear, inputs)
        want = run(TorchBackend(), name, linear, inputs)
    assert got.shape == want.shape == (rows, 1, n)
    error = ((got.double() - want.double()).norm() / want.double().norm()).item()
    assert error < TOLERANCE[weights], f"{route}: relative error {error:.2e}"
    if weights == "fp8-activations" and rows > 1:
        assert route.kernel in (Kernel.FP8_ACT_TRITON, Kernel.FP8_ACT_CUBLASLT, Kernel.FP8_ACT_FLASHINFER)


def test_this_gpu_routes_with_its_packaged_tuning_file():
    """Where a packaged file was measured on this GPU model with these versions, the router uses it: its plans,
    cuBLASLt GEMMs, padded rows and FP8 rule are the routes; elsewhere the defaults (and the skip says why)."""
    device = torch.device("cuda", torch.cuda.current_device())
    name, capability = torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device)
    versions = current_versions()
    matching = [
        t
        for t in packaged_tunings()
        if (t.device_name, t.capability) == (name, capability) and t.versions.matches(versions)
    ]
    if not matching:
        assert tuning_for(device) is DEFAULTS
        pytest.skip(f"no packaged tuning for {name} sm_{capability} with {versions}: `hsmc tune-kernels` writes one")
    tuning = matching[0]
    assert tuning_for(device) == tuning
    router = router_for(device)
    assert router.tuning == tuning
    for (n, k), plan in tuning.one_row_plans.items():
        route = router.plan(torch.Size((1, k)), nn.Linear(k, n, device="meta"), torch.bfloat16)
        assert route.kernel is Kernel.ONE_ROW and route.one_row_plan == plan
    for (n, k), plan in tuning.fp8_one_row_plans.items():
        with torch.device("meta"):
            fp8 = Fp8Linear(k, n, False, QWEN_BLOCK)
        route = router.plan(torch.Size((1, k)), fp8, torch.bfloat16)
        assert route.kernel is Kernel.ONE_ROW and route.one_row_plan == plan
    for (n, k, tile), plan in tuning.few_row_plans.items():
        route = router.plan(torch.Size((8 if tile == 16 else 24, k)), nn.Linear(k, n, device="meta"), torch.bfloat16)
        assert route.kernel is Kernel.FEW_ROWS and route.few_row_plan == plan
    for n, k, rows in tuning.cublaslt_gemms:
        route = router.plan(torch.Size((rows, k)), nn.Linear(k, n, device="meta"), torch.bfloat16)
        assert route.kernel is Kernel.BLAS and route.cublaslt
    for (n, k, rows), run_rows in tuning.padded_rows.items():
        route = router.plan(torch.Size((rows, k)), nn.Linear(k, n, device="meta"), torch.bfloat16, norm_fed=True)
        assert route.kernel is Kernel.BLAS and route.run_rows == run_rows
    if tuning.fp8_block_scaled is not None:
        with torch.device("meta"):
            fp8 = Fp8Linear(5120, 10240, False, QWEN_BLOCK)
        fp8.dynamic_activations = True
        rows = tuning.fp8_block_scaled.min_rows
        flashinfer = tuning.fp8_flashinfer.gemms if tuning.fp8_flashinfer else frozenset()
        rows = next(r for r in range(rows, 1153) if (10240, 5120, r) not in flashinfer)
        assert router.plan(torch.Size((rows, 5120)), fp8, torch.bfloat16).kernel is Kernel.FP8_ACT_CUBLASLT
    if tuning.fp8_flashinfer is not None and flashinfer_gemm.usable(tuning.fp8_flashinfer.version, tuning.source):
        for n, k, rows in tuning.fp8_flashinfer.gemms:
            with torch.device("meta"):
                fp8 = Fp8Linear(k, n, False, QWEN_BLOCK)
            fp8.dynamic_activations = True
            assert router.plan(torch.Size((rows, k)), fp8, torch.bfloat16).kernel is Kernel.FP8_ACT_FLASHINFER
