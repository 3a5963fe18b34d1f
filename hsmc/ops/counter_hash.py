"""The counter-based hash every random number of hsmc comes from (splitmix64), in torch: a draw is a function of
(key, purpose, position), so it needs no generator state and replays inside CUDA graphs. The Triton sampler
(`hsmc.ops.vocab`) computes the same bits on the device; `hsmc.engine.random_streams` keys the rows with it."""

from __future__ import annotations

import torch

_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # as a signed int64
_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_M2 = 0x94D049BB133111EB - (1 << 64)


def _shift(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch shifts arithmetically)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 (wrapping arithmetic): a bijection that scatters nearby inputs."""
    x = (x ^ _shift(x, 30)) * _M1
    x = (x ^ _shift(x, 27)) * _M2
    return x ^ _shift(x, 31)


def combine(key: torch.Tensor, value: torch.Tensor | int) -> torch.Tensor:
    """A key for `value` under `key` (tensors broadcast). An int value is hashed on the host, so no copy to the
    device happens (none may inside a graph capture)."""
    if isinstance(value, int):
        return mix(key + _mix_int(value * _GOLDEN + _GOLDEN))
    return mix(key + mix(value * _GOLDEN + _GOLDEN))


def keys_of_draws(key: torch.Tensor, purpose: int, positions: torch.Tensor | int) -> torch.Tensor:
    """The keys of draws of `purpose` at `positions` ([R], [R, k] or one int) for rows keyed `key` [R]:
    combine(combine(key, purpose), position), one per position."""
    key = combine(key, purpose)
    if isinstance(positions, torch.Tensor) and positions.dim() == 2:
        key = key[:, None]
    return combine(key, positions)


def purpose_salt(purpose: int) -> int:
    """What `combine(key, purpose)` adds to the key before its mix (an int64), for a kernel to do the same."""
    return _mix_int(purpose * _GOLDEN + _GOLDEN)


def splitmix_constants() -> tuple[int, int, int]:
    """The golden-ratio increment and the two multipliers (as signed int64), for a kernel to use the same."""
    return _GOLDEN, _M1, _M2


def _mix_int(x: int) -> int:
    """`mix` of one int64 on the host (Python ints wrapped to 64 bits), the same bits as on the device."""
    mask = (1 << 64) - 1
    x &= mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    x ^= x >> 31
    return x - (1 << 64) if x >= 1 << 63 else x


def uniform(keys: torch.Tensor) -> torch.Tensor:
    """One float64 in (0, 1) per key: 53 random bits, centred so that neither end is reached."""
    return (_shift(mix(keys), 11).double() + 0.5) * 2.0**-53


def gumbel(keys: torch.Tensor, width: int) -> torch.Tensor:
    """float32 Gumbel noise [*keys.shape, width]: entry j from (key, j); the column, not the row, so a row's noise is
    its own (the CUDA sampler's Philox counters do the same)."""
    columns = torch.arange(width, dtype=torch.int64, device=keys.device)
    return -torch.log(-torch.log(uniform(combine(keys[..., None], columns)))).float()
