"""The Linear router and its tuning files: the routes it picks from a GPU's file (without a GPU: only the choice is
checked here, tests/gpu/test_router.py runs them), a file for another GPU or library version left unused with one
log line, the packaged files against the schema, and `hsmc tune-kernels` without a GPU."""

from __future__ import annotations

import dataclasses
import json
import logging
import types
from importlib import resources

import pytest
import torch
from torch import nn

pytest.importorskip("triton")

from hsmc.cli import main  # noqa: E402
from hsmc.models.config import DecoderConfig  # noqa: E402
from hsmc.models.decoder import DecoderLM  # noqa: E402
from hsmc.models.parallel import TensorParallel  # noqa: E402
from hsmc.models.shapes import hf_config  # noqa: E402
from hsmc.ops import flashinfer_gemm, split_k  # noqa: E402
from hsmc.ops.decode_linear import DecodeLinearPlan  # noqa: E402
from hsmc.ops.few_row_linear import FewRowPlan  # noqa: E402
from hsmc.ops.fp8_linear import Fp8Linear  # noqa: E402
from hsmc.ops.kernel_tuning import (  # noqa: E402
    DEFAULTS,
    BlockScaledRows,
    KernelTuning,
    LibraryGemms,
    Versions,
    format_tuning,
    packaged_tunings,
    read_tuning,
    select_tuning,
)
from hsmc.ops.linear_router import Kernel, LinearRouter, Route  # noqa: E402
from hsmc.ops.tune_kernels import QWEN3_LINEARS, qwen3_linears  # noqa: E402

H100 = "NVIDIA H100 80GB HBM3"
MEASURED_WITH = Versions("2.11.0+cu130", "13.0", "13.1.0")
CUDA = torch.device("cuda", 0)
SCHEMA_KEYS = {
    "schema_version",
    "device",
    "versions",
    "measured",
    "one_row_plans",
    "fp8_one_row_plans",
    "few_row_plans",
    "cublaslt_gemms",
    "padded_rows",
    "fp8_weight_only_max_rows",
    "fp8_block_scaled",
    "fp8_flashinfer_version",
    "fp8_flashinfer_gemms",
}


def packaged(name: str) -> KernelTuning:
    return next(t for t in packaged_tunings() if t.device_name == name)


def dense(n: int, k: int) -> nn.Module:
    return nn.Linear(k, n, bias=False, device="meta")


def fp8(n: int, k: int, dynamic: bool, block: tuple[int, int] = (128, 128)) -> Fp8Linear:
    with torch.device("meta"):
        module = Fp8Linear(k, n, False, block)
    module.dynamic_activations = dynamic
    return module


def route(router: LinearRouter, rows: int, linear: nn.Module, **kw) -> Route:
    return router.plan(torch.Size((rows, linear.in_features)), linear, kw.pop("dtype", torch.bfloat16), **kw)


# A tuning with one entry of each kind (values from an H100 sweep), so the routing rules are checked apart from what
# any packaged file happens to hold
TUNED = KernelTuning(
    H100,
    (9, 0),
    MEASURED_WITH,
    "test",
    one_row_plans={(10240, 5120): DecodeLinearPlan(4, 512, 8, 1, False)},
    fp8_one_row_plans={(10240, 5120): DecodeLinearPlan(4, 1024, 2, 3, False)},
    few_row_plans={
        (6144, 4096, 16): FewRowPlan(32, 128, 1, 2, 6),
        (6144, 4096, 32): FewRowPlan(64, 128, 1, 4, 6),
    },
    cublaslt_gemms=frozenset({(5120, 8192, 72), (4096, 12288, 144)}),
    padded_rows={(51200, 5120, 72): 88},
    fp8_weight_only_max_rows=256,
    fp8_block_scaled=BlockScaledRows(144, 16),
)


def test_tuning_routes_dense_linears(monkeypatch):
    """One row: the one-row kernel; 2..16: the few-row kernel with the file's plan for the shape (else the default);
    17..32: the few-row kernel only where the file has a 32-row plan; more: the GEMM, in cuBLASLt where listed, on
    the rows the file pads a norm-fed GEMM to."""
    monkeypatch.setattr(split_k, "multiprocessors", lambda device: 132)
    router = LinearRouter(TUNED, CUDA)
    qkv_8b, o_32b, down_8b, gate_up = dense(6144, 4096), dense(5120, 8192), dense(4096, 12288), dense(51200, 5120)
    assert route(router, 1, qkv_8b) == Route(Kernel.ONE_ROW, 1)  # no measured plan: the kernel's default
    one_row = DecodeLinearPlan(4, 512, 8, 1, False)
    assert route(router, 1, dense(10240, 5120)) == Route(Kernel.ONE_ROW, 1, one_row_plan=one_row)
    assert route(router, 8, qkv_8b) == Route(Kernel.FEW_ROWS, 8, few_row_plan=FewRowPlan(32, 128, 1, 2, 6))
    assert route(router, 24, qkv_8b) == Route(Kernel.FEW_ROWS, 24, few_row_plan=FewRowPlan(64, 128, 1, 4, 6))
    assert route(router, 8, o_32b) == Route(Kernel.FEW_ROWS, 8, few_row_plan=FewRowPlan(32, 256, 1))  # default
    assert route(router, 24, o_32b) == Route(Kernel.BLAS, 24)  # no 32-row plan
    assert route(router, 72, o_32b) == Route(Kernel.BLAS, 72, cublaslt=True)
    assert route(router, 73, o_32b) == Route(Kernel.BLAS, 73)
    assert route(router, 144, down_8b) == Route(Kernel.BLAS, 144, cublaslt=True)
    assert route(router, 72, gate_up, norm_fed=True) == Route(Kernel.BLAS, 88)
    assert route(router, 72, gate_up) == Route(Kernel.BLAS, 72)  # no norm to write the extra rows


def test_fp32_rows_skip_the_few_row_kernel(monkeypatch):
    """fp32 dots run exactly (IEEE), off the tensor cores the few-row kernel is built on: 2..32 fp32 rows go to the
    GEMM even where the tuning holds a few-row plan for the shape; one row keeps the one-row kernel."""
    monkeypatch.setattr(split_k, "multiprocessors", lambda device: 132)
    router = LinearRouter(TUNED, CUDA)
    qkv_8b = dense(6144, 4096)
    assert route(router, 1, qkv_8b, dtype=torch.float32) == Route(Kernel.ONE_ROW, 1)
    for rows in (2, 8, 16, 24, 32):
        assert route(router, rows, qkv_8b, dtype=torch.float32) == Route(Kernel.BLAS, rows)
        assert route(router, rows, qkv_8b).kernel is Kernel.FEW_ROWS


def test_tuning_routes_fp8_linears():
    """FP8 weights: one row weight-only in the one-row kernel; with FP8 activations the Triton GEMM on few rows and
    cuBLASLt's block-scaled GEMM from the tuning's 144 rows, padded to its row multiple, where the weight's layout
    allows it (128x128 blocks, K/128 a multiple of 4, bf16); weight-only the Triton GEMM up to 256 rows."""
    router = LinearRouter(TUNED, CUDA)
    qkv = fp8(10240, 5120, dynamic=True)
    tuned_one_row = Route(Kernel.ONE_ROW, 1, one_row_plan=DecodeLinearPlan(4, 1024, 2, 3, False))
    assert route(router, 1, qkv) == route(router, 1, fp8(10240, 5120, dynamic=False)) == tuned_one_row
    assert route(router, 1, fp8(6144, 4096, dynamic=True)) == Route(Kernel.ONE_ROW, 1)  # not in the file: default
    assert route(router, 1, fp8(10240, 5120, True, (64, 128))) == Route(Kernel.ONE_ROW, 1)  # measured on 128x128
    assert route(router, 16, qkv) == Route(Kernel.FP8_ACT_TRITON, 16)
    assert route(router, 72, qkv) == Route(Kernel.FP8_ACT_TRITON, 72)
    assert route(router, 144, qkv) == Route(Kernel.FP8_ACT_CUBLASLT, 144)
    assert route(router, 150, qkv) == Route(Kernel.FP8_ACT_CUBLASLT, 160)
    assert route(router, 1152, qkv) == Route(Kernel.FP8_ACT_CUBLASLT, 1152)
    assert route(router, 1152, qkv, dtype=torch.float16) == Route(Kernel.FP8_ACT_TRITON, 1152)
    assert route(router, 1152, fp8(10240, 4224, dynamic=True)) == Route(Kernel.FP8_ACT_TRITON, 1152)  # K/128 = 33
    assert route(router, 1152, fp8(10240, 5120, True, (64, 128))) == Route(Kernel.FP8_ACT_TRITON, 1152)
    weight_only = fp8(10240, 5120, dynamic=False)
    assert route(router, 256, weight_only) == Route(Kernel.FP8_TRITON, 256)
    assert route(router, 257, weight_only) == Route(Kernel.FP8_DEQUANTIZED, 257)
    assert route(router, 1, fp8(10240, 5120, False, (4, 128))) == Route(Kernel.FP8_TRITON, 1)  # tiles > block


@pytest.fixture
def flashinfer_installed(monkeypatch):
    """flashinfer 0.7.4 installed and its GEMM supported on the (pretend) Hopper GPU; its version check's log line
    fresh for the test."""
    monkeypatch.setattr(flashinfer_gemm, "installed_version", lambda: "0.7.4")
    monkeypatch.setattr(flashinfer_gemm, "supported", lambda n, k, device: n % 64 == 0 and k % 128 == 0)
    flashinfer_gemm.usable.cache_clear()
    yield monkeypatch
    flashinfer_gemm.usable.cache_clear()


def test_fp8_gemms_the_tuning_measured_faster_in_flashinfer_run_there(flashinfer_installed):
    """The listed (N, K, rows) only, with rows padded to flashinfer's multiple of 4; other rows and shapes keep
    cuBLASLt (or Triton below its threshold)."""
    tuning = dataclasses.replace(
        TUNED,
        fp8_block_scaled=BlockScaledRows(2, 4),
        fp8_flashinfer=LibraryGemms("0.7.4", frozenset({(6144, 4096, 8), (6144, 4096, 126), (4096, 4096, 128)})),
    )
    router = LinearRouter(tuning, CUDA)
    qkv, o = fp8(6144, 4096, dynamic=True), fp8(4096, 4096, dynamic=True)
    assert route(router, 8, qkv) == Route(Kernel.FP8_ACT_FLASHINFER, 8)
    assert route(router, 126, qkv) == Route(Kernel.FP8_ACT_FLASHINFER, 128)
    assert route(router, 128, qkv) == Route(Kernel.FP8_ACT_CUBLASLT, 128)
    assert route(router, 128, o) == Route(Kernel.FP8_ACT_FLASHINFER, 128)
    assert route(router, 8, o) == Route(Kernel.FP8_ACT_CUBLASLT, 8)
    assert route(router, 1, qkv) == Route(Kernel.ONE_ROW, 1)  # one row stays weight-only
    assert route(router, 8, fp8(6144, 4096, dynamic=False)) == Route(Kernel.FP8_TRITON, 8)
    assert route(router, 8, qkv, dtype=torch.float16) == Route(Kernel.FP8_ACT_TRITON, 8)  # bf16 output only


@pytest.mark.parametrize("installed", ["0.7.3", None])
def test_fp8_gemms_measured_with_another_flashinfer_stay_on_cublaslt_with_one_log_line(
    flashinfer_installed, installed, caplog
):
    flashinfer_installed.setattr(flashinfer_gemm, "installed_version", lambda: installed)
    tuning = dataclasses.replace(
        TUNED,
        fp8_block_scaled=BlockScaledRows(2, 4),
        fp8_flashinfer=LibraryGemms("0.7.4", frozenset({(6144, 4096, 8), (4096, 4096, 8)})),
        source="h.json",
    )
    router = LinearRouter(tuning, CUDA)
    with caplog.at_level(logging.WARNING, logger="hsmc.ops.flashinfer_gemm"):
        assert route(router, 8, fp8(6144, 4096, dynamic=True)) == Route(Kernel.FP8_ACT_CUBLASLT, 8)
        assert route(router, 8, fp8(4096, 4096, dynamic=True)) == Route(Kernel.FP8_ACT_CUBLASLT, 8)
    (line,) = [r.getMessage() for r in caplog.records]
    assert "h.json routes FP8 GEMMs to flashinfer 0.7.4" in line and "they run on cuBLASLt" in line
    assert (f"flashinfer {installed} is installed" if installed else "flashinfer is not installed") in line


@pytest.mark.parametrize("name", [H100, "NVIDIA H200"])
def test_packaged_file_routes_as_its_entries_say(name, monkeypatch, flashinfer_installed):
    """Whatever a packaged file holds, the router follows it: its few-row plans, cuBLASLt GEMMs, padded rows and the
    block-scaled FP8 threshold."""
    monkeypatch.setattr(split_k, "multiprocessors", lambda device: 132)
    tuning = packaged(name)
    router = LinearRouter(tuning, CUDA)
    for (n, k), plan in tuning.one_row_plans.items():
        assert route(router, 1, dense(n, k)) == Route(Kernel.ONE_ROW, 1, one_row_plan=plan)
    for (n, k), plan in tuning.fp8_one_row_plans.items():
        assert route(router, 1, fp8(n, k, dynamic=True)) == Route(Kernel.ONE_ROW, 1, one_row_plan=plan)
    for (n, k, tile), plan in tuning.few_row_plans.items():
        assert route(router, tile, dense(n, k)) == Route(Kernel.FEW_ROWS, tile, few_row_plan=plan)
    for n, k, rows in tuning.cublaslt_gemms:
        assert route(router, rows, dense(n, k)).cublaslt
    for (n, k, rows), run in tuning.padded_rows.items():
        assert route(router, rows, dense(n, k), norm_fed=True).run_rows == run
    if tuning.fp8_flashinfer is not None:
        flashinfer_installed.setattr(flashinfer_gemm, "installed_version", lambda: tuning.fp8_flashinfer.version)
    on_flashinfer = tuning.fp8_flashinfer.gemms if tuning.fp8_flashinfer else frozenset()
    if tuning.fp8_block_scaled is not None:
        least, multiple = tuning.fp8_block_scaled.min_rows, tuning.fp8_block_scaled.row_multiple
        for rows in range(least, 1153):
            if (10240, 5120, rows) not in on_flashinfer:
                qkv = fp8(10240, 5120, dynamic=True)
                assert route(router, rows, qkv) == Route(Kernel.FP8_ACT_CUBLASLT, -(-rows // multiple) * multiple)
                break
    if on_flashinfer:
        for n, k, rows in on_flashinfer:
            assert route(router, rows, fp8(n, k, dynamic=True)) == Route(Kernel.FP8_ACT_FLASHINFER, -(-rows // 4) * 4)


def test_cpu_runs_fp8_on_the_reference_and_routes_are_cached():
    router = LinearRouter(DEFAULTS, torch.device("cpu"))
    assert route(router, 3, fp8(256, 512, dynamic=True)) == Route(Kernel.FP8_ACT_REFERENCE, 3)
    assert route(router, 3, fp8(256, 512, dynamic=False)) == Route(Kernel.FP8_DEQUANTIZED, 3)
    linear = dense(256, 512)
    assert route(router, 40, linear) is route(router, 40, linear)


def test_another_gpu_or_version_falls_back_to_the_defaults_with_one_log_line(caplog):
    files = packaged_tunings()
    assert select_tuning(H100, (9, 0), MEASURED_WITH, files).source.endswith(
        "nvidia-h100-80gb-hbm3-torch-2.11.0+cu130.json"
    )
    with caplog.at_level(logging.WARNING, logger="hsmc.ops.kernel_tuning"):
        for _ in range(3):
            assert select_tuning("NVIDIA H100 PCIe", (9, 0), MEASURED_WITH, files) is DEFAULTS
            assert select_tuning(H100, (9, 0), Versions("2.12.0+cu130", "13.0", "13.1.0"), files) is DEFAULTS
            assert select_tuning(H100, (9, 0), Versions("2.11.0+cu130", "13.0", "13.1.0"), [
                KernelTuning(H100, (9, 0), Versions("2.11.0+cu130", "13.0", "13.0.2"), "", source="x.json")
            ]) is DEFAULTS  # fmt: skip
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines
    assert "NVIDIA H100 PCIe" in lines[0] and "no tuning file for this GPU" in lines[0]
    assert "torch 2.12.0+cu130" in lines[1] and "nvidia-h100-80gb-hbm3-torch-2.11.0+cu130.json" in lines[1]
    assert "x.json measured other versions" in lines[2]
    assert all("heuristic defaults" in line and "hsmc tune-kernels" in line for line in lines)


def test_packaged_files_parse_match_the_schema_and_round_trip(tmp_path):
    files = [f for f in (resources.files("hsmc.ops") / "tuning").iterdir() if f.name.endswith(".json")]
    assert len(files) == len(packaged_tunings()) == 2
    for file in files:
        raw = json.loads(file.read_text())
        assert set(raw) == SCHEMA_KEYS, file.name
        tuning = KernelTuning.from_json(raw, file.name)
        assert tuning.device_name in (H100, "NVIDIA H200") and tuning.capability == (9, 0)
        assert tuning.versions.torch == MEASURED_WITH.torch and tuning.versions.cuda == MEASURED_WITH.cuda
        assert {tile for *_, tile in tuning.few_row_plans} == {16, 32} and tuning.cublaslt_gemms
        again = KernelTuning.from_json(json.loads(format_tuning(tuning, {})), file.name)
        assert again == tuning
    broken = json.loads(files[0].read_text())
    del broken["padded_rows"]
    (tmp_path / "broken.json").write_text(json.dumps(broken))
    with pytest.raises(ValueError, match="broken.json.*padded_rows"):
        read_tuning(tmp_path / "broken.json")
    unversioned = {**json.loads(files[0].read_text()), "fp8_flashinfer_version": None}
    unversioned["fp8_flashinfer_gemms"] = [{"n": 4096, "k": 4096, "rows": 8}]
    (tmp_path / "unversioned.json").write_text(json.dumps(unversioned))
    with pytest.raises(ValueError, match="unversioned.json: fp8_flashinfer_gemms need fp8_flashinfer_version"):
        read_tuning(tmp_path / "unversioned.json")
    older = {**json.loads(files[0].read_text()), "schema_version": 3}  # before fp8_one_row_plans
    (tmp_path / "older.json").write_text(json.dumps(older))
    with pytest.raises(ValueError, match=r"older.json: schema_version 3, this hsmc reads 4 \(`hsmc tune-kernels`"):
        read_tuning(tmp_path / "older.json")


def test_the_tuned_shapes_of_a_tensor_parallel_size_are_those_its_ranks_run():
    """What `hsmc tune-kernels --tensor-parallel 1,2,4` times is every Linear weight a rank of the 8B or 32B holds at
    those sizes (`random_model` of each rank's shard, on the meta device), with the norm-fed ones marked."""
    tuned = qwen3_linears((1, 2, 4))
    for shape in ("qwen3-8b", "qwen3-32b"):
        config = DecoderConfig.from_hf(hf_config(shape), source=shape)
        for tp in (1, 2, 4):
            for rank in range(tp):
                with torch.device("meta"):
                    model = DecoderLM(config, TensorParallel(rank, tp), shape)
                held = {tuple(m.weight.shape) for m in model.modules() if isinstance(m, nn.Linear)}
                assert held <= {(n, k) for n, k, _ in tuned.values()}, (shape, tp, rank)
    assert {(n, k) for n, k, _ in tuned.values()} >= {(n, k) for n, k, _ in QWEN3_LINEARS.values()}
    assert tuned["qwen3-32b down tp2"] == (5120, 12800, False)  # row-parallel: K split
    assert tuned["qwen3-8b lm_head tp2"] == (75968, 4096, True)  # vocabulary rows, padded up to a multiple of 2


def test_the_sweep_records_a_one_row_plan_only_where_it_beats_the_default(monkeypatch):
    """`_one_row_plans` with timings given: a plan is recorded for a shape only at most FASTER of the default's time,
    the fastest one; a Linear without a prologue (o) is timed once per plan (fused or not is the same kernel there),
    a down with SiLU·mul on [gate | up] and its residual, as the backend runs it."""
    from hsmc.ops import tune_kernels

    linears = {"qwen3-8b qkv tp4": (1536, 4096, True), "qwen3-8b o tp4": (4096, 1024, False),
               "qwen3-8b down tp4": (4096, 3072, False)}  # fmt: skip
    best = {1536: DecodeLinearPlan(4, 512, 4, 1, True), 4096: DecodeLinearPlan(8, 1024, 8, 1, False)}
    timed: dict[int, list] = {}

    def fake_time(bench, route, chain, inputs):
        n, k = chain[0].weight.shape
        timed.setdefault(k, []).append((route.one_row_plan, inputs))
        if route.one_row_plan is None:
            return 1.0
        if route.one_row_plan == best.get(n):
            return {4096: 0.9, 3072: 0.99}.get(k, 0.9)  # the down's best is within the noise of its default
        return 1.5

    monkeypatch.setattr(tune_kernels, "_chain", lambda linear: [linear])
    monkeypatch.setattr(tune_kernels, "_chain_ms", fake_time)
    dense = {name: nn.Linear(k, n, bias=False, device="meta") for name, (n, k, _) in linears.items()}
    monkeypatch.setattr(tune_kernels, "_inputs", lambda rows, linear, norm, silu=False: {"norm": norm, "silu": silu})
    plans = tune_kernels._one_row_plans(None, linears, dense)
    assert plans == {(1536, 4096): best[1536]}  # o: 4096 x 1024 never met its `best` (fused False is not timed)
    assert len(timed[1024]) == 1 + len(tune_kernels.ONE_ROW_CANDIDATES) // 2
    assert all(plan is None or plan.fuse_prologue for plan, _ in timed[1024])
    assert len(timed[4096]) == len(timed[3072]) == 1 + len(tune_kernels.ONE_ROW_CANDIDATES)
    assert {(i["norm"], i["silu"]) for _, i in timed[3072]} == {(False, True)}
    assert {(i["norm"], i["silu"]) for _, i in timed[4096]} == {(True, False)}

    # FP8 weights: their own candidates (the prologue never fused), every one timed for o as well
    timed.clear()
    best[1536] = best[4096] = tune_kernels.FP8_ONE_ROW_CANDIDATES[7]
    plans = tune_kernels._one_row_plans(None, linears, {name: fp8(n, k, False) for name, (n, k, _) in linears.items()})
    assert plans == {(1536, 4096): best[1536], (4096, 1024): best[4096]}
    for k in (4096, 1024, 3072):
        assert [plan for plan, _ in timed[k]] == [None, *tune_kernels.FP8_ONE_ROW_CANDIDATES]
    assert not any(plan.fuse_prologue for plan in tune_kernels.FP8_ONE_ROW_CANDIDATES)


def test_no_fp8_section_times_an_lm_head():
    """FP8 checkpoints keep their LM head in bf16: the head's shapes, sharded or not, are left out of the FP8 tables."""
    from hsmc.ops import tune_kernels

    linears = qwen3_linears((1, 2, 4))
    heads = [name for name in linears if tune_kernels._is_lm_head(name)]
    assert heads == ["qwen3-8b lm_head", "qwen3-8b lm_head tp2", "qwen3-8b lm_head tp4", "qwen3-32b lm_head",
                     "qwen3-32b lm_head tp2", "qwen3-32b lm_head tp4"]  # fmt: skip
    head_shapes = {linears[name][:2] for name in heads}
    for tuning in packaged_tunings():
        fp8_tables = [*tuning.fp8_one_row_plans, *(tuning.fp8_flashinfer.gemms if tuning.fp8_flashinfer else ())]
        assert not {entry[:2] for entry in fp8_tables} & head_shapes, tuning.source


def test_the_sweep_times_few_row_plans_in_chains_and_records_one_only_where_it_wins(monkeypatch):
    """`_few_row_plans` with timings given: every candidate and the 32-row tile's cuBLAS baseline are timed on the
    same chain; a 16-row plan is recorded at most FASTER of the default plan's time, a 32-row plan at most FASTER of
    cuBLAS's (otherwise those rows stay on the GEMM)."""
    from hsmc.ops import tune_kernels

    linears = {"qwen3-8b gate_up tp2": (12288, 4096, True)}
    dense = {name: nn.Linear(k, n, bias=False, device="meta") for name, (n, k, _) in linears.items()}
    winner = tune_kernels.FEW_ROW_CANDIDATES[5]
    chains, timed = [], []

    def fake_chain(linear):
        chains.append([linear, nn.Linear(linear.in_features, linear.out_features, bias=False, device="meta")])
        return chains[-1]

    def fake_chain_ms(bench, route, chain, inputs):
        timed.append((route, chain))
        if route.kernel is Kernel.BLAS:
            return 0.5  # cuBLAS beats every 32-row plan
        return 0.9 if route.few_row_plan == winner else 1.0

    monkeypatch.setattr(tune_kernels, "_chain", fake_chain)
    monkeypatch.setattr(tune_kernels, "_chain_ms", fake_chain_ms)
    monkeypatch.setattr(tune_kernels, "_inputs", lambda rows, linear, norm, silu=False: {})
    plans = tune_kernels._few_row_plans(None, linears, dense, torch.device("cpu"))
    assert plans == {(12288, 4096, 16): winner}
    assert len(chains) == 1 and all(chain is chains[0] for _, chain in timed)
    kinds = [route.kernel for route, _ in timed]
    assert kinds.count(Kernel.BLAS) == 1
    assert kinds.count(Kernel.FEW_ROWS) == 2 * (1 + len(tune_kernels.FEW_ROW_CANDIDATES))


def test_a_timed_chain_holds_twice_the_l2_caches_bytes_in_distinct_weights(monkeypatch):
    """`_chain`: the Linear first, then new weights of its shape and kind (dense or FP8), at least 2 and at most
    MAX_CHAIN in all, enough that the chain's weights hold twice the L2 cache's bytes (no weight read twice from the
    cache in a replay)."""
    from hsmc.ops import tune_kernels

    l2 = 50 * 2**20
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(L2_cache_size=l2))
    for n, k, want in ((4096, 2048, 7), (24576, 4096, 2), (1024, 256, tune_kernels.MAX_CHAIN)):
        linear = nn.Linear(k, n, bias=False, device="meta", dtype=torch.bfloat16)
        chain = tune_kernels._chain(linear)
        assert chain[0] is linear and len(chain) == want, (n, k)
        assert len({id(c.weight) for c in chain}) == want
        assert all(c.weight.shape == (n, k) and c.weight.dtype == torch.bfloat16 for c in chain)
        if want < tune_kernels.MAX_CHAIN:
            assert want * linear.weight.nbytes >= 2 * l2 > (want - 1) * linear.weight.nbytes or want == 2
    fp8_chain = tune_kernels._chain(tune_kernels._fp8(nn.Linear(4096, 6144, bias=False, device="meta")))
    assert len(fp8_chain) == 5 and all(isinstance(c, Fp8Linear) for c in fp8_chain)  # 24 MiB of e4m3 each
    assert all(c.weight.dtype == torch.float8_e4m3fn and c.weight.shape == (6144, 4096) for c in fp8_chain)


def test_the_weight_only_fp8_threshold_is_the_last_row_count_before_triton_loses(monkeypatch):
    """`_fp8_weight_only_max_rows` with timings given: the Triton GEMM wins at 64 and 128 rows and loses at 256, so
    the threshold is 128; the row counts after the loss are not timed, and the progress bar still reaches its total."""
    from hsmc.ops import tune_kernels

    linears = {"qwen3-8b o": (4096, 4096, False), "qwen3-8b qkv": (6144, 4096, True)}
    modules = {name: fp8(n, k, dynamic=False) for name, (n, k, _) in linears.items()}
    timed = []

    def fake_time(bench, route, linear, inputs):
        timed.append(route.run_rows)
        return (0.5 if route.run_rows <= 128 else 2.0) if route.kernel is Kernel.FP8_TRITON else 1.0

    monkeypatch.setattr(tune_kernels, "_time", fake_time)
    monkeypatch.setattr(tune_kernels, "_inputs", lambda rows, linear, norm, silu=False: {})
    bar_steps = []
    bench = types.SimpleNamespace(bar=types.SimpleNamespace(update=bar_steps.append))
    assert tune_kernels._fp8_weight_only_max_rows(bench, linears, modules) == 128
    assert sorted(set(timed)) == [64, 128, 256]
    assert len(timed) + sum(bar_steps) == 2 * len(modules) * len(tune_kernels.FP8_WEIGHT_ONLY_ROWS)


def test_the_block_scaled_threshold_is_timed_in_chains_from_the_rows_where_cublaslt_always_wins(monkeypatch):
    """`_block_scaled_rows` with timings given: both FP8-activation GEMMs run each shape's one chain (a lone call
    hides the Triton kernels' PDL overlap); cuBLASLt's summed time wins at 2 rows, loses at 8 and 16 and wins from 32
    on, so the threshold is 32, at the row multiple cuBLASLt accepts."""
    from hsmc.ops import tune_kernels

    linears = {"qwen3-8b o": (4096, 4096, False), "qwen3-8b qkv": (6144, 4096, True)}
    modules = {name: fp8(n, k, dynamic=True) for name, (n, k, _) in linears.items()}
    chains, timed = {}, []

    def fake_chain(linear):
        chains[linear.weight.shape[0]] = [linear, fp8(linear.weight.shape[0], linear.weight.shape[1], dynamic=True)]
        return chains[linear.weight.shape[0]]

    def fake_chain_ms(bench, route, chain, inputs):
        timed.append((route, chain))
        if route.kernel is Kernel.FP8_ACT_CUBLASLT:
            return 1.0
        return 0.8 if inputs["rows"] in (8, 16) else 1.1

    monkeypatch.setattr(tune_kernels, "_scaled_mm_row_multiple", lambda device: 4)
    monkeypatch.setattr(tune_kernels, "_chain", fake_chain)
    monkeypatch.setattr(tune_kernels, "_chain_ms", fake_chain_ms)
    monkeypatch.setattr(tune_kernels, "_inputs", lambda rows, linear, norm, silu=False: {"rows": rows})
    assert tune_kernels._block_scaled_rows(None, linears, modules, torch.device("cpu")) == BlockScaledRows(32, 4)
    assert len(timed) == 2 * len(modules) * len(tune_kernels.FP8_ACT_ROWS)
    assert {id(chain) for _, chain in timed} == {id(chain) for chain in chains.values()} and len(chains) == 2
    assert {route.kernel for route, _ in timed} == {Kernel.FP8_ACT_CUBLASLT, Kernel.FP8_ACT_TRITON}


def test_the_sweep_sends_an_fp8_gemm_to_flashinfer_only_where_it_beats_cublaslt(monkeypatch):
    """`_flashinfer_gemms` with timings given: an (N, K, rows) is recorded at most FASTER of cuBLASLt's time, each
    side on the rows it runs (cuBLASLt's multiple, flashinfer's 4), rows below cuBLASLt's threshold not timed; none
    without flashinfer or without cuBLASLt's block-scaled GEMM."""
    from hsmc.ops import tune_kernels

    monkeypatch.setattr(flashinfer_gemm, "installed_version", lambda: "0.7.4")
    monkeypatch.setattr(tune_kernels, "_inputs", lambda rows, linear, norm, silu=False: {"rows": rows})
    linears = {"qwen3-8b o": (4096, 4096, False), "qwen3-8b qkv": (6144, 4096, True)}
    modules = {name: fp8(n, k, dynamic=True) for name, (n, k, _) in linears.items()}
    timed = []

    def fake_chain_ms(bench, route, chain, inputs):
        timed.append((chain[0].weight.shape[0], inputs["rows"], route))
        if route.kernel is Kernel.FP8_ACT_CUBLASLT:
            return 1.0
        return 0.9 if chain[0].weight.shape[0] == 4096 and inputs["rows"] <= 128 else 0.99

    monkeypatch.setattr(tune_kernels, "_chain", lambda linear: [linear])
    monkeypatch.setattr(tune_kernels, "_chain_ms", fake_chain_ms)
    bar_steps = []
    bench = types.SimpleNamespace(bar=types.SimpleNamespace(update=bar_steps.append))
    got = tune_kernels._flashinfer_gemms(bench, linears, modules, BlockScaledRows(8, 16))
    timed_rows = [r for r in tune_kernels.FP8_ACT_ROWS if r >= 8]
    assert got == LibraryGemms("0.7.4", frozenset((4096, 4096, r) for r in timed_rows if r <= 128))
    assert len(timed) == 2 * 2 * len(timed_rows) and sum(bar_steps) == 2 * 2 * (
        len(tune_kernels.FP8_ACT_ROWS) - len(timed_rows)
    )
    for _, rows, route in timed:
        multiple = 16 if route.kernel is Kernel.FP8_ACT_CUBLASLT else 4
        assert route.run_rows == -(-rows // multiple) * multiple
    bar_steps.clear()
    assert tune_kernels._flashinfer_gemms(bench, linears, modules, None) is None
    monkeypatch.setattr(flashinfer_gemm, "installed_version", lambda: None)
    assert tune_kernels._flashinfer_gemms(bench, linears, modules, BlockScaledRows(8, 16)) is None
    assert bar_steps == [2 * 2 * len(tune_kernels.FP8_ACT_ROWS)] * 2  # the bar still reaches its total


def test_tune_kernels_refuses_a_tensor_parallel_size_the_heads_do_not_divide(capsys):
    assert main(["tune-kernels", "--tensor-parallel", "1,3"]) == 2
    assert capsys.readouterr().err == (
        "hsmc: error: engine.tensor_parallel=3: qwen3-8b has 32 attention heads, not divisible by 3\n"
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer without a GPU")
def test_tune_kernels_without_cuda_fails_with_one_line(capsys):
    assert main(["tune-kernels", "--out", "unused.json"]) == 2
    err = capsys.readouterr().err
    assert err == "hsmc: error: hsmc tune-kernels measures kernels on a CUDA GPU and none is visible\n"


CPU_ROUTES = [
    (False, Route(Kernel.ONE_ROW, 1)),
    (False, Route(Kernel.FEW_ROWS, 3, few_row_plan=FewRowPlan(32, 128))),
    (False, Route(Kernel.BLAS, 3)),
    (False, Route(Kernel.BLAS, 8)),  # padded (norm-fed only)
    (True, Route(Kernel.ONE_ROW, 1)),
    (True, Route(Kernel.FP8_TRITON, 3)),
    (True, Route(Kernel.FP8_DEQUANTIZED, 3)),
    (True, Route(Kernel.FP8_ACT_REFERENCE, 3)),
]


@pytest.mark.parametrize("step", ["linear", "norm", "silu"])
@pytest.mark.parametrize("fp8_weight, route", CPU_ROUTES, ids=[f"{r.kernel.value}-{r.run_rows}" for _, r in CPU_ROUTES])
def test_routes_that_run_on_the_cpu_give_the_reference_result(fp8_weight, route, step):
    """Each route the CPU can run through the three Linear steps, against the reference backend on the same module.
    The FP8-activation GEMMs are checked on the GPU (tests/gpu): cuBLASLt's is CUDA-only, and Triton's interpreter
    rounds some values to e4m3 one binade low (test_fp8 checks the Triton GEMM on exactly quantized operands)."""
    from hsmc.models.decoder import RMSNorm
    from hsmc.ops.backend import TorchBackend
    from hsmc.ops.fp8_linear import quantize_fp8
    from hsmc.ops.triton_backend import run_route

    if step != "norm" and route.run_rows > 3:
        pytest.skip("only a norm-fed GEMM runs at more rows than its input")
    torch.manual_seed(route.run_rows)
    rows, n, k = (1 if route.kernel is Kernel.ONE_ROW else 3), 256, 256
    linear = nn.Linear(k, n, bias=False).requires_grad_(False)
    if fp8_weight:
        module = Fp8Linear(k, n, False, (128, 128))
        module.weight.data, module.weight_scale_inv.data = quantize_fp8(linear.weight, (128, 128))
        module.dynamic_activations = route.kernel is Kernel.FP8_ACT_REFERENCE
        linear = module
    norm = RMSNorm(k, 1e-6)
    norm.weight.data = torch.rand(k) + 0.5
    x = torch.randn(rows, 1, 2 * k if step == "silu" else k)
    residual = torch.randn(rows, 1, n)
    reference = TorchBackend()
    with torch.no_grad():
        if step == "linear":
            got, want = run_route(route, x, linear, residual=residual.clone()), reference.linear(x, linear, residual)
        elif step == "norm":
            got, want = (
                run_route(route, x, linear, norm=(norm.weight, norm.eps)),
                reference.norm_linear(x, norm, linear),
            )
        else:
            got = run_route(route, x, linear, silu_mul=True, residual=residual.clone())
            want = reference.silu_linear(x, linear, residual)
    assert got.shape == want.shape == (rows, 1, n)
    assert ((got - want).norm() / want.norm()).item() < 1e-5


class ReadsLikeFlashinfer:
    """A stand-in for flashinfer's GEMM module that reads its operands as its kernels do: rows padded to 4, the
    activation scales column-major with a leading dimension of those rows, the weight scales per 128 x 128 block."""

    def run_gemm(self, q, weight, out, q_scale, scale) -> None:
        from hsmc.ops.fp8_linear import dequantize_fp8

        rows, k = q.shape
        assert rows % 4 == 0 and q_scale.stride() == (1, rows)
        scales = torch.as_strided(q_scale, (k // 128, rows), (rows, 1)).t()  # as the kernel walks its memory
        out.copy_(
            (q.float() * scales.repeat_interleave(128, 1)) @ dequantize_fp8(weight, scale, (128, 128), torch.float32).T
        )


@pytest.mark.parametrize("step", ["linear", "norm", "silu"])
def test_the_flashinfer_route_hands_its_gemm_the_operands_its_kernels_read(step, monkeypatch):
    """The route's prologue (RMSNorm / SiLU·mul / none) quantized into rows padded to 4 with column-major scales, the
    product of those operands in bf16, the residual added: what the same prologue, `quantize_groups` and the
    product give. A row-major scale layout (cuBLASLt's and flashinfer's differ from Triton's) fails here."""
    from hsmc.ops import fused
    from hsmc.ops.fp8_gemm import quantize_groups
    from hsmc.ops.fp8_linear import dequantize_fp8, quantize_fp8
    from hsmc.ops.triton_backend import run_route

    monkeypatch.setattr(flashinfer_gemm, "_runner", lambda device: (ReadsLikeFlashinfer(), None))
    torch.manual_seed(0)
    rows, n, k = 3, 256, 512
    linear = Fp8Linear(k, n, False, (128, 128))
    linear.weight.data, linear.weight_scale_inv.data = quantize_fp8(torch.randn(n, k) / k**0.5, (128, 128))
    linear.dynamic_activations = True
    x = torch.randn(rows, 2 * k if step == "silu" else k).bfloat16()
    norm = ((torch.rand(k) + 0.5).bfloat16(), 1e-6)
    residual = torch.randn(rows, n).bfloat16()
    route = Route(Kernel.FP8_ACT_FLASHINFER, 4)
    with torch.no_grad():
        if step == "norm":
            got, h = run_route(route, x, linear, norm=norm), fused.rms_norm(x, *norm)
        else:
            got = run_route(route, x, linear, silu_mul=step == "silu", residual=residual.clone())
            h = fused.silu_mul(x) if step == "silu" else x
        q, scale = quantize_groups(h, 128)
        want = (
            (q.float() * scale.repeat_interleave(128, 1))
            @ dequantize_fp8(linear.weight, linear.weight_scale_inv, (128, 128), torch.float32).T
        ).bfloat16()
        want = want if step == "norm" else residual + want
    assert got.shape == (rows, n)
    assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2
