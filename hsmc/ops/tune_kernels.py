"""`hsmc tune-kernels`: measure on this GPU the choices the router reads from a tuning file (`kernel_tuning.py`) and
write that file. Each candidate runs as the backend runs it (`triton_backend.run_route`) on random weights of the
Qwen3-8B / 32B Linear shapes at the row counts the engine runs; a choice other than the default is recorded where
it took at most `FASTER` of the default's time (the median of `triton.testing.do_bench`, L2 flushed per call).

The one-row and few-row plans and the FP8-activation GEMMs' libraries are timed as a forward runs those kernels: a
chain of copies of the Linear, more weight bytes than the L2 cache holds, replayed from a CUDA graph, where each
kernel loads its first weights while the one before it finishes (PDL). A lone call cannot show that overlap: on an
H200, timed alone, the 8-row plan picked for the 8B's TP = 2 gate_up ran its chain 1.28x slower than another plan
(docs/measurements/2026-11-30-h200x2-chained-plan-tuning.txt), and cuBLASLt's block-scaled GEMM, picked from 2
rows, ran the FP8 8B's 8-row Linears 1.18-1.37x slower than the Triton GEMM
(docs/measurements/2026-12-01-h200-fp8-routes-and-qkv-rope.txt)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from datetime import date
from pathlib import Path

import torch
import triton
from torch import nn
from tqdm import tqdm
from triton.runtime.errors import OutOfResources

from hsmc.errors import HsmcError
from hsmc.models.config import DecoderConfig
from hsmc.models.decoder import DecoderLM
from hsmc.models.parallel import TensorParallel
from hsmc.models.shapes import RANDOM_PREFIX, hf_config
from hsmc.ops import flashinfer_gemm
from hsmc.ops.decode_linear import DecodeLinearPlan
from hsmc.ops.few_row_linear import FewRowPlan, default_few_row_plan
from hsmc.ops.fp8_gemm import block_scaled_gemm, w8a8_gemm
from hsmc.ops.fp8_linear import QWEN_BLOCK, Fp8Linear, quantize_fp8
from hsmc.ops.kernel_tuning import (
    DEFAULTS,
    BlockScaledRows,
    KernelTuning,
    LibraryGemms,
    current_versions,
    format_tuning,
)
from hsmc.ops.linear_router import Kernel, Route, padded_route
from hsmc.ops.triton_backend import run_route

Linears = dict[str, tuple[int, int, bool]]  # name -> (N, K, fed by an RMSNorm)
TUNED_MODELS = ("qwen3-8b", "qwen3-32b")
NORM_FED = ("qkv", "gate_up", "lm_head")  # the others (o, down) add the residual
SILU_FED = " down"  # a name holding it: the Linear after SiLU·mul (its one-row kernel may fuse that step)


def qwen3_linears(tensor_parallel: Sequence[int] = (1,)) -> Linears:
    """The Linears one rank of Qwen3-8B and Qwen3-32B runs at each tensor-parallel size, read off the models built
    on the meta device: a sharded shape is the one `DecoderLM` holds (q/k/v, gate/up and the LM head split by rows,
    o and down by columns), not a second formula. Shapes two sizes share are tuned once. The LM heads stay bf16 in
    FP8 checkpoints."""
    linears: Linears = {}
    for shape in TUNED_MODELS:
        config = DecoderConfig.from_hf(hf_config(shape), source=f"{RANDOM_PREFIX}{shape}")
        for tp in tensor_parallel:
            with torch.device("meta"):
                model = DecoderLM(config, TensorParallel(0, tp), shape)
            layer = model.model.layers[0]
            modules = {"qkv": layer.self_attn.qkv_proj, "o": layer.self_attn.o_proj, "gate_up": layer.mlp.gate_up_proj,
                       "down": layer.mlp.down_proj, "lm_head": model.lm_head}  # fmt: skip
            for label, module in modules.items():
                n, k = module.weight.shape
                if all((n, k) != (n2, k2) for n2, k2, _ in linears.values()):
                    linears[f"{shape} {label}" + (f" tp{tp}" if tp > 1 else "")] = (n, k, label in NORM_FED)
    return linears


QWEN3_LINEARS = qwen3_linears()  # one GPU's
# One-row plans of dense weights: rows per program (how many programs share the SMs: the sharded Linears of a TP
# rank are narrower), K tile and warps, and whether the prologue runs in the kernel
ONE_ROW_CANDIDATES = [
    DecodeLinearPlan(block_n, block_k, warps, 1, fuse)
    for block_n in (4, 8, 16, 32)
    for block_k in (256, 512, 1024)
    for warps in (4, 8)
    for fuse in (True, False)
]
# FP8 weights: rows per program within a 128-row scale block, K tiles of whole scale blocks, the depth of Triton's
# load pipeline; the prologue always runs as its own kernel (fused, it repeats per program: slower at every shape)
FP8_ONE_ROW_CANDIDATES = [
    DecodeLinearPlan(block_n, block_k, warps, stages, False)
    for block_n in (4, 8, 16)
    for block_k in (512, 1024, 2048)
    for warps in (2, 4)
    for stages in (2, 3, 4)
]
FEW_ROW_CANDIDATES = [
    FewRowPlan(block_n, block_k, 1, warps, stages)
    for block_n in (32, 64)
    for block_k in (128, 256)
    for warps in (2, 4)
    for stages in (4, 6, 8)
]
FEW_ROW_TILES = {16: 8, 32: 32}  # row tile -> rows it is timed at
GEMM_ROWS = (48, 64, 72, 102, 120, 128, 144, 256, 1152)  # verify blocks and proposal steps of the stacks
PAD_ROWS, PAD_STEPS = (72, 144, 1152), (8, 16, 24, 32)
FP8_WEIGHT_ONLY_ROWS = (64, 128, 256, 512, 1024)
FP8_ACT_ROWS = (2, 8, 16, 32, 72, 128, 144, 256, 1152)
SCALED_MM_PROBE_ROWS = (*range(1, 33), 72, 144, 1152)
FASTER = 0.98
MAX_CHAIN = 32  # copies of a Linear in a timed chain (a small one needs many to pass the L2 cache's size)
FP8_CAPABILITY = (8, 9)  # e4m3 in Triton's kernels: Ada, Hopper and newer


def default_path() -> Path:
    """This GPU's file in the package's tuning folder."""
    slug = re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")
    return Path(__file__).parent / "tuning" / f"{slug}-torch-{torch.__version__}.json"


class _Bench:
    """Times closures, one progress bar over all of them."""

    def __init__(self, total: int) -> None:
        self.bar = tqdm(total=total, desc="tune-kernels", unit="timing")

    def ms(self, fn: Callable[[], object]) -> float:
        self.bar.update()
        return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")


def tune_kernels(tensor_parallel: Sequence[int] = (1,)) -> tuple[KernelTuning, str]:
    """Measure this GPU on the Linears one rank runs at each of the `tensor_parallel` sizes; (the tuning, its
    file's text). Shapes a file leaves out run the defaults, so a TP host is tuned with its sizes."""
    linears = qwen3_linears(tensor_parallel)  # first: a size that does not divide the heads is a user error
    if not torch.cuda.is_available():
        raise HsmcError("hsmc tune-kernels measures kernels on a CUDA GPU and none is visible")
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    dense = {name: _dense(n, k, device) for name, (n, k, _) in linears.items()}
    has_fp8 = torch.cuda.get_device_capability(device) >= FP8_CAPABILITY
    fp8 = {name: _fp8(lin) for name, lin in dense.items() if has_fp8 and not _is_lm_head(name)}
    shapes = len(linears)
    flashinfer = [  # FP8 shapes whose GEMM flashinfer can run (none without flashinfer)
        name
        for name, (n, k, _) in linears.items()
        if name in fp8 and flashinfer_gemm.installed_version() and flashinfer_gemm.supported(n, k, device)
    ]
    bench = _Bench(
        sum(len(_one_row_candidates(name, norm, False)) + 1 for name, (*_, norm) in linears.items())
        + len(fp8) * (len(FP8_ONE_ROW_CANDIDATES) + 1)
        + shapes * len(FEW_ROW_TILES) * (len(FEW_ROW_CANDIDATES) + 1)
        + shapes
        + shapes * len(GEMM_ROWS) * 2
        + sum(norm for *_, norm in linears.values()) * len(PAD_ROWS) * (len(PAD_STEPS) + 1)
        + len(fp8) * (len(FP8_WEIGHT_ONLY_ROWS) + len(FP8_ACT_ROWS)) * 2
        + len(flashinfer) * len(FP8_ACT_ROWS) * 2
    )
    with torch.no_grad():
        one_row_plans = _one_row_plans(bench, linears, dense)
        fp8_one_row_plans = _one_row_plans(bench, linears, fp8)
        few_row_plans = _few_row_plans(bench, linears, dense, device)
        cublaslt = _cublaslt_gemms(bench, linears, dense)
        padded = _padded_rows(bench, linears, dense, cublaslt)
        weight_only_max = _fp8_weight_only_max_rows(bench, linears, fp8) if fp8 else DEFAULTS.fp8_weight_only_max_rows
        block_scaled = _block_scaled_rows(bench, linears, fp8, device) if fp8 else None
        on_flashinfer = _flashinfer_gemms(bench, linears, {n: fp8[n] for n in flashinfer}, block_scaled)
    bench.bar.close()
    index = device.index
    tuning = KernelTuning(
        torch.cuda.get_device_name(index),
        torch.cuda.get_device_capability(index),
        current_versions(),
        f"{date.today()}: hsmc tune-kernels --tensor-parallel {','.join(map(str, tensor_parallel))}",
        one_row_plans=one_row_plans,
        fp8_one_row_plans=fp8_one_row_plans,
        few_row_plans=few_row_plans,
        cublaslt_gemms=frozenset(cublaslt),
        padded_rows=padded,
        fp8_weight_only_max_rows=weight_only_max,
        fp8_block_scaled=block_scaled,
        fp8_flashinfer=on_flashinfer,
    )
    labels = {(n, k): name for name, (n, k, _) in linears.items()}
    return tuning, format_tuning(tuning, labels)


def _is_lm_head(name: str) -> bool:
    """An LM head, sharded ("qwen3-8b lm_head tp2") or not: bf16 in the FP8 checkpoints, so no FP8 section times it."""
    return "lm_head" in name.split()


def _dense(n: int, k: int, device: torch.device) -> nn.Linear:
    linear = nn.Linear(k, n, bias=False, device=device, dtype=torch.bfloat16)
    nn.init.normal_(linear.weight, std=k**-0.5)
    return linear.requires_grad_(False)


def _fp8(linear: nn.Linear) -> Fp8Linear:
    n, k = linear.weight.shape
    module = Fp8Linear(k, n, False, QWEN_BLOCK).to(linear.weight.device)
    module.weight.data, module.weight_scale_inv.data = quantize_fp8(linear.weight, QWEN_BLOCK)
    return module


def _inputs(rows: int, linear: nn.Module, norm: bool, silu: bool = False) -> dict:
    """run_route's keywords for a norm-fed Linear or one with a residual (o, down), as the backend calls them;
    `silu`: x is [gate | up] and the route runs SiLU·mul first (as a one-row down does)."""
    k, n = linear.in_features, linear.out_features
    x = torch.randn(rows, 2 * k if silu else k, device=linear.weight.device, dtype=torch.bfloat16)
    if norm:
        return {"x": x, "norm": (torch.ones(k, device=x.device, dtype=x.dtype), 1e-6)}
    return {"x": x, "residual": torch.randn(rows, n, device=x.device, dtype=x.dtype), "silu_mul": silu}


def _chain(linear: nn.Module) -> list[nn.Module]:
    """`linear` and random copies of its shape and kind (dense or FP8): weights of at least twice the L2 cache's
    bytes, so that a chain of them reads every weight from memory, as a forward's Linears do."""
    n, k = linear.weight.shape
    l2 = torch.cuda.get_device_properties(linear.weight.device).L2_cache_size
    copies = min(MAX_CHAIN, max(2, math.ceil(2 * l2 / linear.weight.nbytes)))

    def copy() -> nn.Module:
        dense = _dense(n, k, linear.weight.device)
        return _fp8(dense) if isinstance(linear, Fp8Linear) else dense

    return [linear, *(copy() for _ in range(copies - 1))]


def _chain_ms(bench: _Bench, route: Route, chain: list[nn.Module], inputs: dict) -> float:
    """Milliseconds per call of `route`, each Linear of `chain` called in turn from one CUDA graph; infinite for a
    plan this GPU cannot run."""

    def run() -> None:
        for linear in chain:
            run_route(route, linear=linear, **inputs)

    try:
        run()  # compiled and warmed outside the capture
    except OutOfResources:
        bench.bar.update()
        return math.inf
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph.capture_begin()
        run()
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    return bench.ms(graph.replay) / len(chain)


def _time(bench: _Bench, route: Route, linear: nn.Module, inputs: dict) -> float:
    """Milliseconds; infinite for a candidate this GPU cannot run (a few-row plan's stages beyond its shared memory)."""
    try:
        return bench.ms(lambda: run_route(route, linear=linear, **inputs))
    except OutOfResources:
        return math.inf


def _one_row_plans(bench: _Bench, linears: Linears, modules: dict[str, nn.Module]) -> dict:
    """Per shape of `modules` (dense or FP8), the fastest one-row plan where it beats the default
    (`plan_decode_linear`'s)."""
    plans = {}
    for name, module in modules.items():
        n, k, norm = linears[name]
        inputs = _inputs(1, module, norm, silu=SILU_FED in name)
        chain = _chain(module)
        timed = {
            plan: _chain_ms(bench, Route(Kernel.ONE_ROW, 1, one_row_plan=plan), chain, inputs)
            for plan in (None, *_one_row_candidates(name, norm, isinstance(module, Fp8Linear)))
        }
        best = min(timed, key=timed.get)
        if best is not None and timed[best] <= FASTER * timed[None]:
            plans[n, k] = best
    return plans


def _one_row_candidates(name: str, norm: bool, fp8: bool) -> list[DecodeLinearPlan]:
    """A Linear without a prologue (o) runs the same kernel whether or not the plan fuses one: time it once."""
    if fp8:
        return FP8_ONE_ROW_CANDIDATES
    return [p for p in ONE_ROW_CANDIDATES if p.fuse_prologue or norm or SILU_FED in name]


def _few_row_plans(bench: _Bench, linears: Linears, dense: dict[str, nn.Linear], device: torch.device) -> dict:
    """The fastest plan per shape and row tile; a 32-row plan only where it beats the GEMM."""
    plans = {}
    for name, (n, k, norm) in linears.items():
        chain = _chain(dense[name])
        for tile, rows in FEW_ROW_TILES.items():
            inputs = _inputs(rows, dense[name], norm)
            default = default_few_row_plan(n, k, device)
            timed = {
                plan: _chain_ms(bench, Route(Kernel.FEW_ROWS, rows, few_row_plan=plan), chain, inputs)
                for plan in (default, *FEW_ROW_CANDIDATES)
            }
            best = min(timed, key=timed.get)
            # 2..16 rows take the kernel anyway (its default plan unless another is faster); 17..32 where it wins
            baseline = timed[default] if tile == 16 else _chain_ms(bench, Route(Kernel.BLAS, rows), chain, inputs)
            if timed[best] <= FASTER * baseline:
                plans[n, k, tile] = best
    return plans


def _cublaslt_gemms(bench: _Bench, linears: Linears, dense: dict[str, nn.Linear]) -> set[tuple[int, int, int]]:
    faster = set()
    for name, (n, k, norm) in linears.items():
        for rows in GEMM_ROWS:
            inputs = _inputs(rows, dense[name], norm)
            cublas_ms, cublaslt_ms = (
                _time(bench, Route(Kernel.BLAS, rows, cublaslt=library), dense[name], inputs)
                for library in (False, True)
            )
            if cublaslt_ms <= FASTER * cublas_ms:
                faster.add((n, k, rows))
    return faster


def _padded_rows(
    bench: _Bench, linears: Linears, dense: dict[str, nn.Linear], cublaslt: set
) -> dict[tuple[int, int, int], int]:
    """Norm-fed GEMMs: more rows where the libraries' heuristics pick a faster kernel for them."""
    padded = {}
    for name, (n, k, norm) in linears.items():
        if not norm:
            continue
        for rows in PAD_ROWS:
            inputs = _inputs(rows, dense[name], True)
            timed = {
                run: _time(bench, Route(Kernel.BLAS, run, (n, k, run) in cublaslt), dense[name], inputs)
                for run in (rows, *(rows + step for step in PAD_STEPS))
            }
            best = min(timed, key=timed.get)
            if timed[best] <= FASTER * timed[rows]:
                padded[n, k, rows] = best
    return padded


def _fp8_weight_only_max_rows(bench: _Bench, linears: Linears, fp8: dict[str, Fp8Linear]) -> int:
    """The most rows up to which the Triton weight-only GEMM beats dequantizing for cuBLAS, over all shapes."""
    most = 32
    for i, rows in enumerate(FP8_WEIGHT_ONLY_ROWS):
        triton_ms = dequantized_ms = 0.0
        for name, linear in fp8.items():
            inputs = _inputs(rows, linear, linears[name][2])
            triton_ms += _time(bench, Route(Kernel.FP8_TRITON, rows), linear, inputs)
            dequantized_ms += _time(bench, Route(Kernel.FP8_DEQUANTIZED, rows), linear, inputs)
        if triton_ms > dequantized_ms:
            bench.bar.update(2 * len(fp8) * (len(FP8_WEIGHT_ONLY_ROWS) - 1 - i))  # counted in the total, not timed
            break
        most = rows
    return most


def _block_scaled_rows(
    bench: _Bench, linears: Linears, fp8: dict[str, Fp8Linear], device: torch.device
) -> BlockScaledRows | None:
    """cuBLASLt block-scaled FP8: the row multiple it accepts, and the fewest rows from which it beats Triton."""
    multiple = _scaled_mm_row_multiple(device)
    if multiple is None:
        return None
    chains = {name: _chain(linear) for name, linear in fp8.items()}
    wins = []
    for rows in FP8_ACT_ROWS:
        cublaslt = padded_route(Kernel.FP8_ACT_CUBLASLT, rows, multiple)
        triton_ms = cublaslt_ms = 0.0
        for name, linear in fp8.items():
            inputs = _inputs(rows, linear, linears[name][2])
            triton_ms += _chain_ms(bench, Route(Kernel.FP8_ACT_TRITON, rows), chains[name], inputs)
            cublaslt_ms += _chain_ms(bench, cublaslt, chains[name], inputs)
        wins.append(cublaslt_ms <= FASTER * triton_ms)
    first = next((i for i in range(len(wins)) if all(wins[i:])), None)
    return BlockScaledRows(FP8_ACT_ROWS[first], multiple) if first is not None else None


def _flashinfer_gemms(
    bench: _Bench, linears: Linears, fp8: dict[str, Fp8Linear], block_scaled: BlockScaledRows | None
) -> LibraryGemms | None:
    """FP8-activation GEMMs (N, K, rows) that flashinfer runs faster than cuBLASLt, with the version measured (None:
    flashinfer not installed, or cuBLASLt's block-scaled GEMM unused on this GPU)."""
    version = flashinfer_gemm.installed_version()
    if version is None or block_scaled is None:
        bench.bar.update(2 * len(fp8) * len(FP8_ACT_ROWS))  # counted in the bar's total, not timed
        return None
    faster = set()
    for name, linear in fp8.items():
        n, k, norm = linears[name]
        chain = _chain(linear)
        for rows in FP8_ACT_ROWS:
            if rows < block_scaled.min_rows:  # counted in the bar's total: two timings each
                bench.bar.update(2)
                continue
            inputs = _inputs(rows, linear, norm)
            cublaslt = padded_route(Kernel.FP8_ACT_CUBLASLT, rows, block_scaled.row_multiple)
            flashinfer = padded_route(Kernel.FP8_ACT_FLASHINFER, rows, flashinfer_gemm.ROW_MULTIPLE)
            cublaslt_ms = _chain_ms(bench, cublaslt, chain, inputs)
            if _chain_ms(bench, flashinfer, chain, inputs) <= FASTER * cublaslt_ms:
                faster.add((n, k, rows))
    return LibraryGemms(version, frozenset(faster))


def _scaled_mm_row_multiple(device: torch.device) -> int | None:
    """The smallest power of two whose every probed multiple cuBLASLt's block-scaled GEMM runs and agrees with the
    Triton GEMM on (None: none)."""
    weight, scale = quantize_fp8(torch.randn(256, 512, device=device), QWEN_BLOCK)
    ok = {}
    for rows in SCALED_MM_PROBE_ROWS:
        x = torch.randn(rows, 512, device=device, dtype=torch.bfloat16)
        try:
            got = block_scaled_gemm(x, weight, scale, rows).float()
        except RuntimeError:  # CUBLAS_STATUS_NOT_SUPPORTED
            ok[rows] = False
            continue
        want = w8a8_gemm(x, weight, scale, QWEN_BLOCK).float()
        ok[rows] = bool((got - want).norm() <= 1e-3 * want.norm())
    return next((p for p in (1, 2, 4, 8, 16, 32) if all(v for rows, v in ok.items() if rows % p == 0)), None)
