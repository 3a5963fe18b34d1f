"""cuBLAS or cuBLASLt for a dense GEMM, chosen per GPU model and shape as measured.

torch sends every bf16 GEMM to one library (`torch.backends.cuda.preferred_blas_library`: cuBLAS unless set), and
at the token counts of a verify the two run different kernels: on an H200 the Qwen3-32B's `o` and `down` over the
72 tokens of an SMC-SD verify (N = 8, K = 8) take 17 % and 6 % less time through cuBLASLt, while `down` over 102
tokens (N = 6, K = 16) takes 12 % more. So the GEMMs listed here switch to cuBLASLt for their own call (a CUDA graph
keeps the kernel chosen at capture) and every other GEMM keeps torch's choice. Entries are (N, K, M) of the weight
[N, K] and the rows M, written where two runs of `scripts/gpu_engine_check.py --sections blasroutes` both found
cuBLASLt ≥ 2 % faster (the median of interleaved rounds, each matrix chained four times in a graph, called as
`_matmul` calls it); the two libraries' products differ by ≤ 3.3e-4 (relative) there.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from hsmc.ops.few_row_linear import gpu_name

CUBLASLT_GEMMS: dict[str, frozenset[tuple[int, int, int]]] = {
    # 2026-11-26: faster in both of two sweeps (H200s); SMC-SD N = 8, K = 8 cycles 1.3-3.5 % faster
    "NVIDIA H200": frozenset(
        {
            (10240, 5120, 102),  # qwen3-32b qkv: 0.927 / 0.942x
            (10240, 5120, 144),  # qwen3-32b qkv: 0.834 / 0.843x
            (5120, 8192, 72),  # qwen3-32b o: 0.819 / 0.824x
            (5120, 8192, 102),  # qwen3-32b o: 0.941 / 0.929x
            (5120, 8192, 288),  # qwen3-32b o: 0.974 / 0.980x
            (5120, 25600, 72),  # qwen3-32b down: 0.932 / 0.933x
            (4096, 4096, 48),  # qwen3-8b o: 0.865 / 0.872x
            (4096, 4096, 144),  # qwen3-8b o: 0.917 / 0.901x
            (4096, 12288, 48),  # qwen3-8b down: 0.893 / 0.901x
            (4096, 12288, 64),  # qwen3-8b down: 0.897 / 0.900x
            (4096, 12288, 72),  # qwen3-8b down: 0.900 / 0.907x
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
