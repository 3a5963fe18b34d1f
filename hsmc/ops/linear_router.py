"""Which kernel runs a Linear: the one place that decides, from the input's shape, the weight (dense or block-scaled
FP8, FP8 activations or not) and the GPU's measured tuning (`kernel_tuning.py`). `TritonBackend` executes the
route it returns (`triton_backend.run_route`).

Why these routes: one row is bound by reading the weight and runs the fused one-row kernel; a few rows still are,
and the few-row kernel reads the weight on the tensor cores with the rows padded to one tile; more rows are
GEMMs, where the vendor libraries win (which library, and at how many rows, is measured per GPU). FP8 weights
keep their bytes halved through the Triton GEMMs; FP8 activations (`engine.fp8_activations`) go to the FP8 tensor
cores, through cuBLASLt's block-scaled GEMM where the tuning measured it faster than Triton, and through flashinfer's
(`flashinfer_gemm.py`, optional) for the shapes and rows where it measured faster than cuBLASLt."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum
from functools import cache

import torch
from torch import nn

from hsmc.ops import flashinfer_gemm
from hsmc.ops.decode_linear import DecodeLinearPlan
from hsmc.ops.few_row_linear import MAX_ROWS, FewRowPlan, default_few_row_plan
from hsmc.ops.fp8_gemm import block_scaled_supported
from hsmc.ops.fp8_linear import QWEN_BLOCK, Fp8Linear
from hsmc.ops.kernel_tuning import KernelTuning, tuning_for

FEW_ROWS_WITHOUT_PLAN = 16  # the few-row kernel's default plan beats cuBLAS up to here (one 16-row tile)


class Kernel(str, Enum):
    ONE_ROW = "one_row"  # decode_linear: prologue, Linear and residual in one kernel (dense or FP8 weights)
    FEW_ROWS = "few_rows"  # few_row_linear: dense weights, rows padded to a 16/32-row tile
    BLAS = "blas"  # torch's GEMM on dense weights, in cuBLAS or cuBLASLt
    FP8_TRITON = "fp8_triton"  # fp8_gemm: FP8 weights, activations in the model's dtype
    FP8_DEQUANTIZED = "fp8_dequantized"  # the weight dequantized, then torch's GEMM (many rows; the CPU)
    FP8_ACT_TRITON = "fp8_act_triton"  # quantize_groups (in the prologue's kernel) + w8a8_matmul: FP8 x FP8 in Triton
    FP8_ACT_CUBLASLT = "fp8_act_cublaslt"  # the same quantizers + block_scaled_matmul (cuBLASLt's block-scaled GEMM)
    FP8_ACT_FLASHINFER = "fp8_act_flashinfer"  # the same quantizers + flashinfer_block_scaled_matmul
    FP8_ACT_REFERENCE = "fp8_act_reference"  # quantize_activations + the dequantized GEMM (the CPU)


@dataclass(frozen=True)
class Route:
    """A kernel, the rows it runs at (more than the input's where measured faster or required: the extra rows are
    never read back, as a GEMM's output row depends on its input row alone), and its settings."""

    kernel: Kernel
    run_rows: int
    cublaslt: bool = False  # BLAS: cuBLASLt instead of torch's preferred library
    few_row_plan: FewRowPlan | None = None
    one_row_plan: DecodeLinearPlan | None = None  # ONE_ROW: measured (None: `plan_decode_linear`)


def padded_route(kernel: Kernel, rows: int, multiple: int) -> Route:
    """`kernel` at `rows` rounded up to the multiple of rows its GEMM runs (the FP8 libraries' row tiles)."""
    return Route(kernel, -(-rows // multiple) * multiple)


class LinearRouter:
    """Routes for the Linears on one device, cached per shape (decided from Python ints: no device reads)."""

    def __init__(self, tuning: KernelTuning, device: torch.device) -> None:
        self.tuning = tuning
        self.device = device
        self.cuda = device.type == "cuda"
        self._routes: dict[tuple, Route] = {}

    def plan(self, x_shape: torch.Size, linear: nn.Module, dtype: torch.dtype, norm_fed: bool = False) -> Route:
        """The route of linear(prologue(x)) for x of `x_shape` in `dtype`; `norm_fed`: the prologue is an RMSNorm
        (which can write its rows into a taller buffer for free)."""
        rows = math.prod(x_shape[:-1])
        n, k = linear.weight.shape
        fp8 = isinstance(linear, Fp8Linear)
        key = (rows, n, k, dtype, norm_fed, fp8 and linear.block, fp8 and linear.dynamic_activations)
        route = self._routes.get(key)
        if route is None:
            route = self._routes[key] = (
                self._fp8(rows, n, k, linear.block, linear.dynamic_activations, dtype)
                if fp8
                else self._dense(rows, n, k, norm_fed, dtype)
            )
        return route

    def _dense(self, rows: int, n: int, k: int, norm_fed: bool, dtype: torch.dtype) -> Route:
        if rows == 1:
            return Route(Kernel.ONE_ROW, 1, one_row_plan=self.tuning.one_row_plans.get((n, k)))
        # fp32 rows multiply exactly (IEEE), off the tensor cores the few-row kernel is built on: on an H200 it took
        # 25 us a SmolLM2 Linear with its split-K sum, cuBLAS's SGEMM 5.6-9.3 (2026-11-28-h200-fp32-rows-step-unit.txt)
        if rows <= MAX_ROWS and dtype != torch.float32:
            plan = self.tuning.few_row_plans.get((n, k, 16 if rows <= 16 else 32))
            if rows <= FEW_ROWS_WITHOUT_PLAN:
                return Route(Kernel.FEW_ROWS, rows, few_row_plan=plan or default_few_row_plan(n, k, self.device))
            if plan is not None:
                return Route(Kernel.FEW_ROWS, rows, few_row_plan=plan)
        run_rows = self.tuning.padded_rows.get((n, k, rows), rows) if norm_fed else rows
        return Route(Kernel.BLAS, run_rows, cublaslt=(n, k, run_rows) in self.tuning.cublaslt_gemms)

    def _fp8(self, rows: int, n: int, k: int, block: tuple[int, int], dynamic: bool, dtype: torch.dtype) -> Route:
        if rows == 1 and block[0] % 8 == 0:  # the one-row kernel's weight tiles must fit a scale block
            measured = self.tuning.fp8_one_row_plans if block == QWEN_BLOCK else {}  # timed with these blocks
            return Route(Kernel.ONE_ROW, 1, one_row_plan=measured.get((n, k)))
        quantize = dynamic and rows > 1  # one row stays weight-only: bound by the weight read
        if not self.cuda:
            return Route(Kernel.FP8_ACT_REFERENCE if quantize else Kernel.FP8_DEQUANTIZED, rows)
        if quantize:
            scaled = self.tuning.fp8_block_scaled
            if scaled is not None and rows >= scaled.min_rows and block_scaled_supported(n, k, block, dtype):
                if self._flashinfer_faster(n, k, rows):
                    return padded_route(Kernel.FP8_ACT_FLASHINFER, rows, flashinfer_gemm.ROW_MULTIPLE)
                return padded_route(Kernel.FP8_ACT_CUBLASLT, rows, scaled.row_multiple)
            return Route(Kernel.FP8_ACT_TRITON, rows)
        if rows <= self.tuning.fp8_weight_only_max_rows:
            return Route(Kernel.FP8_TRITON, rows)
        return Route(Kernel.FP8_DEQUANTIZED, rows)

    def _flashinfer_faster(self, n: int, k: int, rows: int) -> bool:
        """The tuning measured this GEMM faster in flashinfer, and that flashinfer is installed."""
        measured = self.tuning.fp8_flashinfer
        return (
            measured is not None
            and (n, k, rows) in measured.gemms
            and flashinfer_gemm.supported(n, k, self.device)
            and flashinfer_gemm.usable(measured.version, self.tuning.source)
        )


def router_for(device: torch.device) -> LinearRouter:
    """The router of a device: one per GPU, whether it is named `cuda` or `cuda:0`."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _router(device)


@cache
def _router(device: torch.device) -> LinearRouter:
    return LinearRouter(tuning_for(device), device)
