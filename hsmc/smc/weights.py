"""Importance-weight increments of one SMC-SD cycle (DESIGN.md §3), the log-normalizer of a power
draw, and the effective sample size.

The target is p'^alpha, p' the target's law at the request's temperature T, cut to its top-k / top-p support (a
floor on the raw logits; -inf: no cut). Per particle, with target logits L_0..L_K over [seed, d_1..d_K], proposal
log-probs lq_j, scale s = 1/T and log p'_j(x) = s·L_j[x] − log Σ_{L_j[y] >= floor_j} exp(s·L_j[y]) on the support
(−inf off it):
    inc_j = alpha * log p'_j(d_j) - lq_j                                    (j < K)
    logZ  = log Σ_x p'_K(x)^alpha                                           (0 when alpha = 1)
    delta = sum(inc[:kept]) + (logZ if the bonus is kept, i.e. kept = K + 1)
`kept` (1..K+1) counts the cycle's new tokens [d_1..d_K, bonus] that belong to the output: all of
them, or those up to the token that ends it (a stop token, the token completing a stop string, the
max_tokens-th token). Tokens past the end never enter the weight, so the particle system
targets p'^alpha over the outputs as they are returned. Scoring uses the same tempered, cut log-probs
that the bonus is sampled from (a known accuracy trap is scoring with T = 1). A draft off the support weighs
−inf: the particle is dropped at the next resampling. Results are float64.
"""

from __future__ import annotations

import torch

from hsmc.ops.backend import Backend, TorchBackend


def logsumexp_scaled(
    logits: torch.Tensor, scale: torch.Tensor, floor: torch.Tensor, backend: Backend | None = None
) -> torch.Tensor:
    """float64 logsumexp of scale · ℓ over the entries ℓ >= floor, for logits [..., V] and scale (float64) and floor
    [...]: one pass over the logits through the stack's `backend` (a Triton kernel, or torch: the reference)."""
    flat = logits.reshape(-1, logits.shape[-1])
    lse = (backend or TorchBackend()).logsumexp_rows(flat, scale.reshape(-1).double(), floor.reshape(-1).float())
    return lse.view(logits.shape[:-1])


def log_normalizer(
    logits: torch.Tensor,
    alpha: float,
    scale: torch.Tensor,
    floor: torch.Tensor,
    lse: torch.Tensor | None = None,
    backend: Backend | None = None,
) -> torch.Tensor:
    """log Σ_x p'(x)^alpha for each row of logits [R, V] (scale and floor [R]): the weight of a token drawn from
    p'^alpha normalized in place of p'^alpha (float64; 0 when alpha = 1). `lse`: logsumexp(scale·ℓ) over the
    support, if already known."""
    if alpha == 1:
        return torch.zeros(logits.shape[:-1], dtype=torch.float64, device=logits.device)
    lse = logsumexp_scaled(logits, scale, floor, backend) if lse is None else lse
    return logsumexp_scaled(logits, alpha * scale, floor, backend) - alpha * lse


def weight_increments(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_logq: torch.Tensor,
    kept: torch.Tensor,
    alpha: float,
    scale: torch.Tensor,
    floor: torch.Tensor,
    backend: Backend | None = None,
) -> torch.Tensor:
    """delta log-weight float64 [N] for target_logits [N, K+1, V] (any float dtype), drafts/logq [N, K], kept [N] in
    1..K+1, scale [N] (float64 1/T) and floor [N, K+1]. The log-sum-exps are float64 reductions that never hold a
    float64 copy of the logits (at 128 particles x 9 positions of a 152k vocabulary such copies took ~4 GB on an
    H200)."""
    k = draft_tokens.shape[1]
    per_position = scale[:, None].expand(-1, k + 1)
    lse = logsumexp_scaled(target_logits, per_position, floor, backend)  # [N, K+1]
    at = target_logits[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)
    drafted = torch.where(at.float() >= floor[:, :k], at.double() * scale[:, None], float("-inf"))
    inc = alpha * (drafted - lse[:, :k]) - draft_logq.double()
    counted = torch.arange(k, device=kept.device)[None, :] < kept[:, None]
    log_z = log_normalizer(target_logits[:, k], alpha, scale, floor[:, k], lse[:, k], backend)
    return torch.where(counted, inc, 0.0).sum(1) + torch.where(kept > k, log_z, 0.0)


def effective_sample_size(logw: torch.Tensor) -> torch.Tensor:
    """ESS = 1 / sum(w~^2) with w~ = softmax(logw) over the last dim (particles of a group); 0 for a group whose
    weights are all 0 (every particle left its target's support)."""
    w = torch.softmax(logw.double(), dim=-1)
    return torch.nan_to_num(1.0 / (w * w).sum(-1), nan=0.0)
