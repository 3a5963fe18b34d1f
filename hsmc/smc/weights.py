"""Importance-weight increments of one SMC-SD cycle (DESIGN.md §3), the log-normalizer of a power
draw, and the effective sample size.

Per particle, with target logits L_0..L_K over [seed, d_1..d_K], proposal log-probs lq_j and
power alpha at target temperature T:
    inc_j = alpha * log_softmax(L_j / T)[d_j] - lq_j                      (j < K)
    logZ  = logsumexp(alpha * L_K / T) - alpha * logsumexp(L_K / T)       (0 when alpha = 1)
    delta = sum(inc[:kept]) + (logZ if the bonus is kept, i.e. kept = K + 1)
`kept` (1..K+1) counts the cycle's new tokens [d_1..d_K, bonus] that belong to the output: all of
them, or those up to the token that ends it (a stop token, the token completing a stop string, the
max_new_tokens-th token). Tokens past the end never enter the weight, so the particle system
targets p_T^alpha over the outputs as they are returned. Scoring uses the same tempered log-probs
that the bonus is sampled from (a known accuracy trap is scoring with T = 1). Results are float64.
"""

from __future__ import annotations

import torch


def logsumexp_scaled(logits: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 logsumexp(scale · ℓ) over the last dim of logits [..., V]: one pass over the logits in a Triton
    kernel on CUDA (`hsmc.ops.vocab`), torch on the CPU."""
    if logits.is_cuda:
        from hsmc.ops.vocab import logsumexp_rows

        return logsumexp_rows(logits.reshape(-1, logits.shape[-1]), scale).view(logits.shape[:-1])
    return torch.logsumexp(logits.double() * scale, -1)


def log_normalizer(
    logits: torch.Tensor, alpha: float, temperature: float, lse: torch.Tensor | None = None
) -> torch.Tensor:
    """log Σ_x p_T(x)^alpha for each row of logits [..., V]: the weight of a token drawn from softmax(alpha·ℓ/T)
    in place of p_T^alpha (float64; 0 when alpha = 1). `lse`: logsumexp(ℓ/T) of the rows, if already known."""
    if alpha == 1:
        return torch.zeros(logits.shape[:-1], dtype=torch.float64, device=logits.device)
    lse = logsumexp_scaled(logits, 1 / temperature) if lse is None else lse
    return logsumexp_scaled(logits, alpha / temperature) - alpha * lse


def weight_increments(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_logq: torch.Tensor,
    kept: torch.Tensor,
    alpha: float,
    temperature: float,
) -> torch.Tensor:
    """delta log-weight float64 [N] for target_logits [N, K+1, V] (any float dtype), drafts/logq [N, K] and kept
    [N] in 1..K+1. The log-sum-exps are float64 reductions that never hold a float64 copy of the logits (at 128
    particles x 9 positions of a 152k vocabulary such copies took ~4 GB on an H200)."""
    k = draft_tokens.shape[1]
    lse = logsumexp_scaled(target_logits, 1 / temperature)  # [N, K+1]
    drafted = target_logits[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1).double() / temperature
    inc = alpha * (drafted - lse[:, :k]) - draft_logq.double()
    counted = torch.arange(k, device=kept.device)[None, :] < kept[:, None]
    log_z = log_normalizer(target_logits[:, k], alpha, temperature, lse[:, k])
    return torch.where(counted, inc, 0.0).sum(1) + torch.where(kept > k, log_z, 0.0)


def effective_sample_size(logw: torch.Tensor) -> torch.Tensor:
    """ESS = 1 / sum(w~^2) with w~ = softmax(logw) over the last dim (particles of a group)."""
    w = torch.softmax(logw.double(), dim=-1)
    return 1.0 / (w * w).sum(-1)
