"""Training-time test (DESIGN §4): the head unrolled over its own outputs, as it drafts at inference.

Index t of a sequence pairs the verifier's feature f_t with token x_{t+1}. Step 0 reads fc(f_t);
step k reads the head's own pre-norm output of step k-1 at the same index, the token x_{t+1+k}
and RoPE position t+k, and predicts x_{t+2+k}. Its query attends to the step-0 keys at indices
<= t and to the keys of steps 1..k at index t — exactly what a query sees at draft step k of
inference. Loss: sum_k 0.8^k soft cross-entropy against softmax(verifier logits restricted to the
draft vocabulary) at the predicted position, on response tokens whose verifier argmax is in it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hsmc.eagle.head import Eagle3Head
from hsmc.models.decoder import rope_cos_sin, rotate_half


@dataclass
class TTTBatch:
    features: torch.Tensor  # [B, T, 3H]: verifier residual streams low‖mid‖high at positions 0..T-1
    tokens: torch.Tensor  # int64 [B, T]: the sequence x_0..x_{T-1}
    target_logits: torch.Tensor  # [B, T, V]: verifier logits at positions 0..T-1 (predicting x_{t+1})
    loss_mask: torch.Tensor  # bool [B, T]: position t's prediction (of x_{t+1}) is a response token


@dataclass
class TTTOutput:
    loss: torch.Tensor
    accuracy: list[float]  # per step: top-1 agreement with the verifier on masked positions


def ttt_loss(head: Eagle3Head, embed: nn.Embedding, batch: TTTBatch, steps: int = 7, decay: float = 0.8) -> TTTOutput:
    attn = head.midlayer.self_attn
    b, t, _ = batch.features.shape
    n = t - 1  # indices 0..T-2 have a next token x_{t+1}
    hidden = head.fc(batch.features[:, :n])
    target_logp = torch.log_softmax(batch.target_logits.float()[..., head.t2d], -1)  # [B, T, draft]
    in_draft = head.t2d[batch.target_logits.argmax(-1)]
    keys: list[tuple[torch.Tensor, torch.Tensor]] = []
    causal = torch.tril(torch.ones(n, n, dtype=torch.bool, device=hidden.device))
    total = torch.zeros((), device=hidden.device)
    accuracy = []
    for k in range(steps):
        valid = torch.arange(n, device=hidden.device) + 1 + k < t  # x_{t+1+k} exists
        idx = (torch.arange(n, device=hidden.device) + 1 + k).clamp_max(t - 1)
        layer = head.midlayer
        embeds = embed(batch.tokens[:, idx]).to(hidden.dtype)
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], -1)
        q = attn.q_proj(x).view(b, n, attn.num_heads, attn.head_dim)
        kk = attn.k_proj(x).view(b, n, attn.num_kv_heads, attn.head_dim)
        v = attn.v_proj(x).view(b, n, attn.num_kv_heads, attn.head_dim)
        positions = (torch.arange(n, device=hidden.device) + k)[None].expand(b, n)
        cos, sin = rope_cos_sin(head.inv_freq, head.config.rope_attention_scaling, positions, q.dtype)
        q, kk = q * cos + rotate_half(q) * sin, kk * cos + rotate_half(kk) * sin
        rep = attn.num_heads // attn.num_kv_heads
        kk, v = kk.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
        keys.append((kk, v))
        scale = attn.head_dim**-0.5
        k0, v0 = keys[0]
        scores0 = torch.einsum("bqhd,bkhd->bhqk", q, k0) * scale
        scores0 = scores0.masked_fill(~causal, float("-inf"))
        diag = [torch.einsum("bqhd,bqhd->bhq", q, kj) * scale for kj, _ in keys[1:]]
        weights = torch.softmax(torch.cat([scores0, *[d[..., None] for d in diag]], -1), -1)
        out = torch.einsum("bhqk,bkhd->bqhd", weights[..., :n], v0)
        for j, (_, vj) in enumerate(keys[1:]):
            out = out + weights[..., n + j].transpose(1, 2)[..., None] * vj
        h = hidden + attn.o_proj(out.reshape(b, n, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        logp = torch.log_softmax(head.lm_head(head.norm(h)).float(), -1)
        target_pos = (torch.arange(n, device=hidden.device) + 1 + k).clamp_max(t - 1)
        mask = batch.loss_mask[:, target_pos] & in_draft[:, target_pos] & valid[None]
        tgt = target_logp[:, target_pos]
        ce = -(tgt.exp() * logp).sum(-1)
        denom = mask.sum().clamp_min(1)
        total = total + decay**k * (ce * mask).sum() / denom
        agree = (logp.argmax(-1) == tgt.argmax(-1)) & mask
        accuracy.append(float(agree.sum() / denom))
        hidden = h
    return TTTOutput(total, accuracy)
