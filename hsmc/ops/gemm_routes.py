"""How a dense GEMM runs on this GPU model, as measured: in cuBLAS or cuBLASLt, and at how many rows.

torch sends every bf16 GEMM to one library (`torch.backends.cuda.preferred_blas_library`: cuBLAS unless set), and
at the token counts of a verify the two run different kernels: on an H200 the Qwen3-32B's `o` and `down` over the
72 tokens of an SMC-SD verify (N = 8, K = 8) take 17 % and 6 % less time through cuBLASLt, while `down` over 102
tokens (N = 6, K = 16) takes 12 % more. So the GEMMs in `CUBLASLT_GEMMS` switch to cuBLASLt for their own call (a
CUDA graph keeps the kernel chosen at capture) and every other GEMM keeps torch's choice. Entries are (N, K, M) of
the weight [N, K] and the rows M, written where runs of `scripts/sweep_kernels.py --parts cublaslt` found
cuBLASLt ≥ 2 % faster (both of two on an H100, three of four on H200s; the median of interleaved rounds, each
matrix chained four times in a graph, called as `_matmul` calls it).

Both libraries' heuristics also pick a slow kernel at some row counts: the 32B's `gate_up` takes 159 µs over 72
rows and 143 µs over 88 on an H200. A GEMM after an RMSNorm (`qkv`, `gate_up`, the LM head) can run at more rows
for free: the norm writes its rows into a taller buffer whose extra rows are never read back (a GEMM's output rows
depend on their own input rows only). `PADDED_ROWS` maps (N, K, M) to the rows to run where both of two sweeps
found that ≥ 2 % faster (the 32B's norm-fed matrices at 8..32 more rows; the 8B's were not swept). The two
libraries' products differ by ≤ 3.4e-4 (relative); the taller `gate_up`'s first rows equal the 72-row GEMM's bit for
bit on an H200. The tables hold for the cuBLAS of the torch build measured (2.11, CUDA 13).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from hsmc.ops.few_row_linear import gpu_name

CUBLASLT_GEMMS: dict[str, frozenset[tuple[int, int, int]]] = {
    # 2026-11-26: faster in at least three of four sweeps (H200s); SMC-SD N = 8, K = 8 cycles 1.3-3.5 % faster
    "NVIDIA H200": frozenset(
        {
            (10240, 5120, 102),  # qwen3-32b qkv: 0.927 / 0.942 / 0.939 / 0.936x
            (10240, 5120, 144),  # qwen3-32b qkv: 0.834 / 0.843 / 0.842 / 0.845x
            (5120, 8192, 72),  # qwen3-32b o: 0.819 / 0.824 / 0.831 / 0.829x
            (5120, 8192, 102),  # qwen3-32b o: 0.941 / 0.929 / 0.953 / 0.953x
            (5120, 25600, 72),  # qwen3-32b down: 0.932 / 0.933 / 0.930 / 0.929x
            (4096, 4096, 48),  # qwen3-8b o: 0.865 / 0.872 / 0.869 / 0.873x
            (4096, 4096, 144),  # qwen3-8b o: 0.917 / 0.901 / 0.906 / 0.895x
            (4096, 12288, 48),  # qwen3-8b down: 0.893 / 0.901 / 0.895 / 0.897x
            (4096, 12288, 64),  # qwen3-8b down: 0.897 / 0.900 / 0.893 / 0.896x
            (4096, 12288, 72),  # qwen3-8b down: 0.900 / 0.907 / 0.907 / 0.908x
            (4096, 12288, 144),  # qwen3-8b down: - / 0.980 / 0.963 / 0.968x
        }
    ),
    # 2026-11-26: faster in both of two sweeps (an H100); SMC-SD N = 8, K = 8 cycles 1.4-3.0 % faster
    "NVIDIA H100 80GB HBM3": frozenset(
        {
            (10240, 5120, 144),  # qwen3-32b qkv: 0.926 / 0.922x
            (5120, 8192, 72),  # qwen3-32b o: 0.835 / 0.835x
            (5120, 8192, 102),  # qwen3-32b o: 0.815 / 0.817x
            (5120, 25600, 72),  # qwen3-32b down: 0.914 / 0.916x
            (5120, 25600, 102),  # qwen3-32b down: 0.928 / 0.929x
            (4096, 12288, 48),  # qwen3-8b down: 0.929 / 0.930x
            (4096, 12288, 64),  # qwen3-8b down: 0.924 / 0.923x
            (4096, 12288, 72),  # qwen3-8b down: 0.921 / 0.921x
            (4096, 12288, 120),  # qwen3-8b down: 0.904 / 0.904x
            (4096, 12288, 144),  # qwen3-8b down: 0.871 / 0.872x
        }
    ),
}


# (N, K, M) -> rows to run the GEMM at
PADDED_ROWS: dict[str, dict[tuple[int, int, int], int]] = {
    # 2026-11-26: faster in both of two sweeps (an H200); SMC-SD N = 8, K = 8 cycles 0.2-2.1 % faster
    "NVIDIA H200": {
        (51200, 5120, 72): 88,  # qwen3-32b gate_up: 0.899 / 0.896x
        (51200, 5120, 1152): 1160,  # qwen3-32b gate_up: 0.956 / 0.967x
    },
}


def gemm_rows(n: int, k: int, rows: int, device: torch.device) -> int:
    """The rows a GEMM of `rows` input rows should run at on this GPU (`rows` unless measured faster taller)."""
    return PADDED_ROWS.get(gpu_name(device), {}).get((n, k, rows), rows)


@contextmanager
def blas_library_for(n: int, k: int, rows: int, device: torch.device) -> Iterator[None]:
    """cuBLASLt inside the block where this GPU measured it faster for the shape; torch's choice elsewhere."""
    if (n, k, rows) not in CUBLASLT_GEMMS.get(gpu_name(device), ()):
        yield
        return
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library("cublaslt")
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)
