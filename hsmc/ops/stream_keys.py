"""The keys of a batch of draws, (row key, purpose, position) hashed with `counter_hash`'s splitmix64, in one kernel
on CUDA (`TritonBackend.stream_keys`; `counter_hash.keys_of_draws` is the reference, and the bits are the same). In
torch ops the two `combine`s of a key take about forty elementwise kernels, paid at each draw of a step or round.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hsmc.ops.counter_hash import purpose_salt, splitmix_constants

_GOLDEN, _M1, _M2 = splitmix_constants()


@triton.jit
def _mix(x, m1, m2):
    """splitmix64's finalizer on uint64 (logical shifts, wrapping products)."""
    x = (x ^ (x >> 30)) * m1
    x = (x ^ (x >> 27)) * m2
    return x ^ (x >> 31)


@triton.jit
def _u64(x):
    """An int argument's 64 bits as uint64 (Triton passes small ints as int32)."""
    return x.to(tl.int64).to(tl.uint64, bitcast=True)


@triton.jit
def _stream_keys_kernel(
    key_ptr, rows_ptr, positions_ptr, out_ptr, salt, position, golden, m1, m2, n, K,
    POSITIONS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = i < n
    row = tl.load(rows_ptr + i // K, mask=live, other=0)
    key = tl.load(key_ptr + row, mask=live, other=0).to(tl.uint64, bitcast=True)
    if POSITIONS:
        pos = tl.load(positions_ptr + i, mask=live, other=0).to(tl.uint64, bitcast=True)
    else:
        pos = tl.zeros([BLOCK], dtype=tl.uint64) + _u64(position)
    g, a, b = _u64(golden), _u64(m1), _u64(m2)
    purposed = _mix(key + _u64(salt), a, b)
    out = _mix(purposed + _mix(pos * g + g, a, b), a, b)
    tl.store(out_ptr + i, out.to(tl.int64, bitcast=True), mask=live)


def stream_keys(key: torch.Tensor, rows: torch.Tensor, purpose: int, positions: torch.Tensor | int) -> torch.Tensor:
    """`counter_hash.keys_of_draws(key[rows], purpose, positions)` in one kernel: int64 [R] or [R, k]."""
    shape = positions.shape if isinstance(positions, torch.Tensor) else rows.shape
    out = torch.empty(shape, dtype=torch.int64, device=key.device)
    n = out.numel()
    if n == 0:
        return out
    k = shape[1] if len(shape) == 2 else 1
    given = isinstance(positions, torch.Tensor)
    pos = positions.contiguous() if given else out  # a placeholder pointer without positions
    block = min(1024, triton.next_power_of_2(n))
    _stream_keys_kernel[(triton.cdiv(n, block),)](
        key, rows, pos, out, purpose_salt(purpose), 0 if given else int(positions), _GOLDEN, _M1, _M2, n, k,
        POSITIONS=given, BLOCK=block,
    )  # fmt: skip
    return out
