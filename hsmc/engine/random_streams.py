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

from hsmc.ops.backend import Backend, TorchBackend
from hsmc.ops.counter_hash import combine, mix

# what a level draws (a level's salt is its depth under the top of its stack, so no two levels share a stream)
DRAW, ACCEPT, RESIDUAL, SELECT, RESAMPLE, RENEW = range(6)


class RowStreams:
    """The key of every row of a stack (the scratch row included), shared by its levels."""

    def __init__(self, max_rows: int, device: torch.device, backend: Backend | None = None) -> None:
        self.key = torch.zeros(max_rows + 1, dtype=torch.int64, device=device)
        self.backend = backend or TorchBackend()  # the stack's: one kernel per batch of keys on CUDA

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
        return self.backend.stream_keys(self.key, rows, purpose, positions)


def purpose_of(salt: int, use: int) -> int:
    """The purpose id of a level's draws of one use (`DRAW`, `ACCEPT`, ...)."""
    return salt * 8 + use
