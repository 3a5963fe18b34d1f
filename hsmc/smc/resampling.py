"""Resampling ancestors and final selection from log-weights, given the caller's uniforms.

The functions are pure: the caller draws the uniforms from its random streams, so a run is
reproducible and the functions are testable against plain-Python references. Groups are rows
of `logw` [G, N] (one SMC request = one group of N particles). A group of fewer particles (requests
with different N in one batch) fills the first `counts[g]` columns; the rest are padding with log-weight
-inf (weight 0), which no ancestor points to and which keep their own index.
"""

from __future__ import annotations

import torch

from hsmc.smc.weights import effective_sample_size


def _inverse_cdf(logw: torch.Tensor, points: torch.Tensor, counts: torch.Tensor | None) -> torch.Tensor:
    """Particle index whose cumulative normalized weight first reaches each point in [0, 1). A group whose weights
    are all 0 draws its particles uniformly (its log Ẑ is -inf: nothing of it is kept but the new start)."""
    n = logw.shape[-1]
    used = torch.arange(n, device=logw.device)[None, :] < (n if counts is None else counts[:, None])
    dead = (torch.isneginf(logw) | ~used).all(-1, keepdim=True)
    logw = torch.where(dead & used, 0.0, logw.double())
    cdf = torch.cumsum(torch.softmax(logw, dim=-1), dim=-1)
    idx = torch.searchsorted(cdf, points.double(), right=True)
    last = logw.shape[-1] - 1 if counts is None else (counts - 1)[:, None]
    return idx.clamp_max(last)  # the cdf at the last particle may round to just below 1


def _keep_padding(ancestors: torch.Tensor, counts: torch.Tensor | None) -> torch.Tensor:
    if counts is None:
        return ancestors
    index = torch.arange(ancestors.shape[-1], device=ancestors.device)
    return torch.where(index < counts[:, None], ancestors, index)


def systematic_ancestors(logw: torch.Tensor, uniform: torch.Tensor, counts: torch.Tensor | None = None) -> torch.Tensor:
    """Systematic resampling: one uniform u per group, points (u + i) / N; int64 [G, N] (N: the group's count)."""
    n = logw.shape[-1]
    size = n if counts is None else counts[:, None].double()
    points = (uniform.double()[:, None] + torch.arange(n, device=logw.device, dtype=torch.float64)) / size
    return _keep_padding(_inverse_cdf(logw, points, counts), counts)


def multinomial_ancestors(
    logw: torch.Tensor, uniforms: torch.Tensor, counts: torch.Tensor | None = None
) -> torch.Tensor:
    """Multinomial resampling: N independent uniforms per group [G, N]; int64 [G, N]."""
    return _keep_padding(_inverse_cdf(logw, uniforms, counts), counts)


def select_particle(logw: torch.Tensor, mode: str, gumbel: torch.Tensor | None = None) -> torch.Tensor:
    """Index of the returned particle per group: `sample` draws it ∝ weights (Gumbel-max with the
    caller's Gumbel noise [G, N]); `argmax` takes the heaviest."""
    if mode == "argmax":
        return logw.argmax(-1)
    if mode == "sample":
        if gumbel is None:
            raise ValueError("select_particle(mode='sample') needs Gumbel noise")
        return (logw.double() + gumbel.double()).argmax(-1)
    raise ValueError(f"selection must be 'sample' or 'argmax', got {mode!r}")


def resampling_plan(
    logw: torch.Tensor,
    live: torch.Tensor,
    uniforms: torch.Tensor,
    threshold: float,
    scheme: str,
    counts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The resampling decision of every group, made on the device: (ancestors int64 [G, N], resample bool [G],
    ESS float64 [G]). A live group (some particle unfinished) resamples when its ESS < threshold·N (N: its
    `counts` entry, default all columns); the others get identity ancestors, so the caller applies one fork to
    all groups with no branch on the host. `uniforms`: [G] for `systematic`, [G, N] for `multinomial`."""
    n = logw.shape[-1] if counts is None else counts
    ess = effective_sample_size(logw)
    resample = live & (ess < threshold * n)
    if scheme == "systematic":
        drawn = systematic_ancestors(logw, uniforms, counts)
    else:
        drawn = multinomial_ancestors(logw, uniforms, counts)
    identity = torch.arange(logw.shape[-1], device=logw.device).expand_as(drawn)
    return torch.where(resample[:, None], drawn, identity), resample, ess
