"""flashinfer's block-scaled FP8 GEMM for Hopper (TensorRT-LLM's SM90 kernels, which JIT-compile DeepGEMM's for each
shape), an optional route for FP8 activations beside cuBLASLt's.

Why: on an H200 it ran the Qwen3-8B's four Linears at 16-128 rows in 0.60-0.74 of cuBLASLt's time (the SMC proposal
steps), while cuBLASLt stays ahead at 144 rows and level at 1152
(docs/measurements/2026-11-30-h200-flashinfer-fp8-gemm.txt). So where it runs is measured data: `hsmc tune-kernels`
records each (N, K, rows) it wins at the row counts it times, with the flashinfer version measured
(`kernel_tuning.LibraryGemms`); other row counts, or another version or none installed, stay on cuBLASLt. Install
with `pip install "hsmc[flashinfer]"`. Its first use builds the module with nvcc (~100 s on an H200 host, then cached
by flashinfer) and each new GEMM shape compiles in ~2 s (cached by DeepGEMM's JIT)."""

from __future__ import annotations

import importlib.metadata
import logging
from functools import cache
from typing import Any

import torch

log = logging.getLogger(__name__)
CAPABILITY = (9, 0)  # its kernels use Hopper's wgmma and TMA
N_MULTIPLE, K_MULTIPLE, ROW_MULTIPLE = 64, 128, 4  # the kernels' tiles; scales are read with rows padded to 4


def installed_version() -> str | None:
    try:
        return importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        return None


def supported(n: int, k: int, device: torch.device) -> bool:
    return (
        device.type == "cuda"
        and torch.cuda.get_device_capability(device) == CAPABILITY
        and n % N_MULTIPLE == 0
        and k % K_MULTIPLE == 0
    )


@cache
def usable(measured_version: str, source: str) -> bool:
    """Whether the flashinfer a tuning file measured (`source`) is the one installed; else one log line."""
    installed = installed_version()
    if installed == measured_version:
        return True
    found = f"flashinfer {installed} is installed" if installed else "flashinfer is not installed"
    log.warning(
        "kernel tuning: %s routes FP8 GEMMs to flashinfer %s, but %s: they run on cuBLASLt "
        '(pip install "flashinfer-python==%s" to use them)',
        source, measured_version, found, measured_version,
    )  # fmt: skip
    return False


def _runner(device: torch.device) -> tuple[Any, torch.Tensor]:
    """The GEMM module on one GPU and the workspace it is configured with (its FP8 x FP8 path writes none, but the
    module refuses to run without one)."""
    return _runner_on(device.index if device.index is not None else torch.cuda.current_device())


@cache
def _runner_on(device_index: int) -> tuple[Any, torch.Tensor]:
    from flashinfer.gemm.gemm_base import get_fp8_blockscale_gemm_runner_sm90

    log.info("flashinfer: loading the FP8 block-scale GEMM module (its first build on this machine takes ~2 min)")
    with torch.cuda.device(device_index):
        runner = get_fp8_blockscale_gemm_runner_sm90()
        workspace = torch.empty(4096, dtype=torch.uint8, device="cuda")
        runner.configure_workspace(workspace)
    return runner, workspace


def flashinfer_block_scaled_matmul(
    q: torch.Tensor, q_scale: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, rows: int
) -> torch.Tensor:
    """(q * q_scale) @ dequant(weight [N, K] e4m3, scale [N/128, K/128])^T in bf16, the first `rows` rows: q
    [run_rows, K] e4m3 (run_rows a multiple of 4) with its scales per row and 128 columns column-major, as
    `quantize_groups(..., run_rows, column_major_scales=True)` writes them for cuBLASLt (the layout TensorRT-LLM's
    kernels read too)."""
    if q.shape[0] % ROW_MULTIPLE or q_scale.stride() != (1, q.shape[0]):
        raise ValueError(f"flashinfer's FP8 GEMM needs rows padded to {ROW_MULTIPLE} and column-major scales")
    runner, _ = _runner(q.device)
    out = torch.empty(q.shape[0], weight.shape[0], dtype=torch.bfloat16, device=q.device)
    runner.run_gemm(q, weight, out, q_scale, scale)
    return out[:rows]
