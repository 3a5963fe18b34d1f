"""Training-time test (DESIGN §4): the head unrolled over its own outputs, as it drafts at inference.

Index t of a sequence pairs the verifier's feature f_t with token x_{t+1}. Step 0 reads fc(f_t);
step k reads the head's own pre-norm output of step k-1 at the same index, the token x_{t+1+k}
and RoPE position t+k, and predicts x_{t+2+k}. Its query attends to the step-0 keys at indices
<= t and to the keys of steps 1..k at index t — exactly what a query sees at draft step k of
inference. The unroll runs through the head's own paged forward (the one drafting uses), with that
attention pattern as an explicit mask and every step's keys in one fresh KV cache.
Loss: sum_k 0.8^k soft cross-entropy against softmax(verifier logits restricted to the draft
vocabulary) at the predicted position, on response tokens whose verifier argmax is in it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hsmc.eagle.head import Eagle3Head
from hsmc.ops.backend import TorchBackend
from hsmc.ops.batch import ForwardBatch
from hsmc.ops.kv_cache import KVCache


@dataclass
class TTTBatch:
    features: torch.Tensor  # [B, T, 3H]: verifier residual streams low‖mid‖high at positions 0..T-1
    tokens: torch.Tensor  # int64 [B, T]: the sequence x_0..x_{T-1}
    embeds: torch.Tensor  # [B, T, H]: the verifier's (frozen) embeddings of x_0..x_{T-1}
    target_logits: torch.Tensor  # [B, T, V]: verifier logits at positions 0..T-1 (predicting x_{t+1})
    loss_mask: torch.Tensor  # bool [B, T]: position t's prediction (of x_{t+1}) is a response token


@dataclass
class TTTOutput:
    loss: torch.Tensor
    accuracy: list[float]  # per step: top-1 agreement with the verifier on masked positions


def ttt_attention_batch(b: int, n: int, step: int, steps: int, device: torch.device) -> ForwardBatch:
    """Step `step` of the unroll as a paged forward: row b's table holds the keys of step m at columns
    m·n .. m·n+n-1 (slots b·steps·n + column); index t's query (RoPE position t+step) sees the step-0
    keys at columns <= t and the step-1..step keys at index t (an explicit mask)."""
    table = torch.arange(b + 1, device=device)[:, None] * steps * n + torch.arange(steps * n, device=device)
    idx = torch.arange(n, device=device)
    context = (step + 1) * n
    key = torch.arange(context, device=device)
    key_step, key_index = key // n, key % n
    mask = torch.where(key_step[None, :] == 0, key_index[None, :] <= idx[:, None], key_index[None, :] == idx[:, None])
    rows = torch.arange(b, device=device)
    return ForwardBatch(
        rows=rows,
        table=table,
        tokens=torch.zeros(b, n, dtype=torch.int64, device=device),
        positions=(idx + step)[None].expand(b, n),
        write_slots=table[rows, step * n : step * n + n],
        start=torch.full((b,), step * n, dtype=torch.int64, device=device),
        num_new=torch.full((b,), n, dtype=torch.int64, device=device),
        max_context=context,
        mask=mask[None].expand(b, n, context),
    )


def ttt_unroll(head: Eagle3Head, features: torch.Tensor, embeds: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Draft logits [B, T-1, Vd] of every unroll step: step k at index t reads x_{t+1+k} (its embedding in
    `embeds`) and predicts x_{t+2+k}."""
    b, t, _ = features.shape
    n = t - 1  # indices 0..T-2 have a next token x_{t+1}
    device = features.device
    hidden = head.fc(features[:, :n])
    attn = head.midlayer.self_attn
    cache = KVCache(1, b * steps * n, attn.heads.num_kv_heads, attn.heads.head_dim, hidden.dtype, device)
    backend = TorchBackend()
    logits_per_step = []
    for k in range(steps):
        idx = (torch.arange(n, device=device) + 1 + k).clamp_max(t - 1)
        batch = ttt_attention_batch(b, n, k, steps, device)
        hidden, logits = head(batch, cache, backend, embeds=embeds[:, idx].to(hidden.dtype), hidden=hidden)
        logits_per_step.append(logits)
    return logits_per_step


def ttt_loss(head: Eagle3Head, batch: TTTBatch, steps: int = 7, decay: float = 0.8) -> TTTOutput:
    """Step k's prediction at index i (of x_{i+2+k}) is scored against the verifier at position i+1+k, which
    exists for i < T-1-k: the targets of every step are one tensor sliced, not gathered (on a 2-core CPU the
    per-step gathers, exps and argmaxes over [B, T, draft] took about a fifth of the loss's forward and backward)."""
    t = batch.features.shape[1]
    target_logp = torch.log_softmax(batch.target_logits.float()[..., head.t2d], -1)  # [B, T, draft]
    target_p, target_top = target_logp.exp(), target_logp.argmax(-1)
    scored = batch.loss_mask & head.t2d[batch.target_logits.argmax(-1)]  # a response token the draft vocab holds
    total = torch.zeros((), device=batch.features.device)
    accuracy = []
    for k, logits in enumerate(ttt_unroll(head, batch.features, batch.embeds, steps)):
        at = slice(1 + k, t)  # the positions step k predicts, for indices 0 .. T-2-k
        logp = torch.log_softmax(logits[:, : t - 1 - k].float(), -1)
        mask = scored[:, at]
        ce = -(target_p[:, at] * logp).sum(-1)
        denom = mask.sum().clamp_min(1)
        total = total + decay**k * (ce * mask).sum() / denom
        accuracy.append(float(((logp.argmax(-1) == target_top[:, at]) & mask).sum() / denom))
    return TTTOutput(total, accuracy)
