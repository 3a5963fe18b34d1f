"""Per-request random streams: counter-based random numbers keyed by a row's key, what is drawn and where.

A seeded request must decode the same tokens alone or amid others, and a batch's draws from one shared generator
depend on which rows share it and on how many rounds the batch runs. So no draw here comes from a generator:
each row holds a 64-bit key (its request's seed, its particle index), and a draw is a hash of (key, purpose,
position) — the level and use (a draft, an acceptance test, a correction or bonus, a resampling) and the sequence
position of the token it decides. Counter-based numbers need no state, so they replay inside CUDA graphs as they
are.

Reusing a (key, purpose, position) is sound where the earlier draw left nothing behind: a draft past a rejected
one, a round an idle row runs masked, the bonus of a deferred SMC step are all discarded, and nothing kept
depends on them. Resampling is the exception: a copy continues its ancestor's tokens, so the rows of a resampled
group take fresh keys (`renew`), and no two particles ever draw with one key.
"""

from __future__ import annotations

import torch

_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)  # as a signed int64
_M1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_M2 = 0x94D049BB133111EB - (1 << 64)

# what a level draws (a level's salt is its depth under the top of its stack, so no two levels share a stream)
DRAW, ACCEPT, RESIDUAL, SELECT, RESAMPLE, RENEW = range(6)


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


class RowStreams:
    """The key of every row of a stack (the scratch row included), shared by its levels."""

    def __init__(self, max_rows: int, device: torch.device) -> None:
        self.key = torch.zeros(max_rows + 1, dtype=torch.int64, device=device)

    def seed(self, rows: torch.Tensor, seeds: torch.Tensor, particles: torch.Tensor) -> None:
        """Start the rows' streams: particle `particles[i]` of a request seeded `seeds[i]`."""
        self.key[rows] = combine(mix(seeds), particles)

    def renew(self, rows: torch.Tensor, renewed: torch.Tensor) -> None:
        """Fresh keys for the rows where `renewed` holds (a resampled group), the others unchanged."""
        key = self.key[rows]
        self.key[rows] = torch.where(renewed, combine(key, RENEW), key)

    def keys(self, rows: torch.Tensor, purpose: int, positions: torch.Tensor | int) -> torch.Tensor:
        """Per row, the key of one draw: `purpose` (a level's salt and use, `purpose_of`) at `positions` ([R] or
        [R, k]: one key per position)."""
        key = combine(self.key[rows], purpose)
        if isinstance(positions, torch.Tensor) and positions.dim() == 2:
            key = key[:, None]
        return combine(key, positions)


def purpose_of(salt: int, use: int) -> int:
    """The purpose id of a level's draws of one use (`DRAW`, `ACCEPT`, ...)."""
    return salt * 8 + use
