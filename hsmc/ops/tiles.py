"""Triton device functions that several kernels share: the reference's rounding and the weight-tile load, in one
place so that every kernel rounds and reads weights the same way."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """Round fp32 values to `dtype` and back, as a torch op producing `dtype` would."""
    return x.to(dtype).to(tl.float32)


@triton.jit
def weight_tile(w_rows, n_ok, cols, K):
    """Columns `cols` of the program's weight rows (zeros past N and K); each byte is read once: evict first."""
    return tl.load(
        w_rows + cols[None, :], mask=n_ok[:, None] & (cols < K)[None, :], other=0.0, eviction_policy="evict_first"
    )
