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


def log_normalizer(logits: torch.Tensor, alpha: float, temperature: float) -> torch.Tensor:
    """log Σ_x p_T(x)^alpha for each row of logits [..., V]: the weight of a token drawn from softmax(alpha·ℓ/T)
    in place of p_T^alpha (float64; 0 when alpha = 1)."""
    scaled = logits.double() / temperature
    return torch.logsumexp(alpha * scaled, -1) - alpha * torch.logsumexp(scaled, -1)


def weight_increments(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_logq: torch.Tensor,
    kept: torch.Tensor,
    alpha: float,
    temperature: float,
) -> torch.Tensor:
    """delta log-weight float64 [N] for target_logits [N, K+1, V] (any float dtype), drafts/logq [N, K] and kept
    [N] in 1..K+1. Each position is scored in float64 on its own, so the float64 temporaries are [N, V], not
    [N, K+1, V]: scored at once, 128 particles x 9 positions of a 152k vocabulary held ~4 GB of them (H200)."""
    k = draft_tokens.shape[1]
    inc = torch.zeros(draft_tokens.shape[0], dtype=torch.float64, device=draft_tokens.device)
    for j in range(k):
        scaled = target_logits[:, j].double() / temperature
        logp = scaled.gather(-1, draft_tokens[:, j, None]).squeeze(-1) - torch.logsumexp(scaled, -1)
        inc += torch.where(kept > j, alpha * logp - draft_logq[:, j].double(), 0.0)
    log_z = log_normalizer(target_logits[:, k], alpha, temperature)
    return inc + torch.where(kept > k, log_z, 0.0)


def effective_sample_size(logw: torch.Tensor) -> torch.Tensor:
    """ESS = 1 / sum(w~^2) with w~ = softmax(logw) over the last dim (particles of a group)."""
    w = torch.softmax(logw.double(), dim=-1)
    return 1.0 / (w * w).sum(-1)
