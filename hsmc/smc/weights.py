"""Importance-weight increments of one SMC-SD cycle (DESIGN.md §3), and the effective sample size.

Per particle, with target logits L_0..L_K over [seed, d_1..d_K], proposal log-probs lq_j and
power alpha at target temperature T:
    inc_j = alpha * log_softmax(L_j / T)[d_j] - lq_j                      (j < K)
    logZ  = logsumexp(alpha * L_K / T) - alpha * logsumexp(L_K / T)       (0 when alpha = 1)
    e     = first EOS among [d_1..d_K, bonus]
    delta = 0 if already finished, sum(inc[:e+1]) if e < K, else sum(inc) + logZ
Scoring uses the same tempered log-probs that the bonus is sampled from (a known accuracy trap
is scoring with T = 1), and tokens after EOS never enter the weight. Results are float64.
"""

from __future__ import annotations

import torch


def first_eos(tokens: torch.Tensor, eos_ids: torch.Tensor) -> torch.Tensor:
    """Index of the first EOS in each row of `tokens` [N, M]; M where there is none."""
    is_eos = torch.isin(tokens, eos_ids)
    positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
    return torch.where(is_eos, positions, tokens.shape[1]).min(dim=1).values


def weight_increments(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_logq: torch.Tensor,
    bonus: torch.Tensor,
    finished: torch.Tensor,
    eos_ids: torch.Tensor,
    alpha: float,
    temperature: float,
) -> torch.Tensor:
    """delta log-weight float64 [N] for target_logits [N, K+1, V], drafts/logq [N, K], bonus [N]."""
    k = draft_tokens.shape[1]
    scaled = target_logits.double() / temperature
    logp = torch.log_softmax(scaled[:, :k], dim=-1).gather(-1, draft_tokens[..., None]).squeeze(-1)
    inc = alpha * logp - draft_logq.double()
    last = scaled[:, k]
    log_z = torch.logsumexp(alpha * last, -1) - alpha * torch.logsumexp(last, -1)
    e = first_eos(torch.cat([draft_tokens, bonus[:, None]], dim=1), eos_ids)
    counted = torch.arange(k, device=inc.device)[None, :] <= e[:, None]
    delta = (inc * counted).sum(-1) + torch.where(e >= k, log_z, 0.0)
    return torch.where(finished, 0.0, delta)


def effective_sample_size(logw: torch.Tensor) -> torch.Tensor:
    """ESS = 1 / sum(w~^2) with w~ = softmax(logw) over the last dim (particles of a group)."""
    w = torch.softmax(logw.double(), dim=-1)
    return 1.0 / (w * w).sum(-1)
