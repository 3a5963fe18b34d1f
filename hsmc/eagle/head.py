"""The EAGLE3 draft head (DESIGN.md §4), parameter names as in SGLang / vLLM / SpecForge checkpoints.

Inputs per position: the verifier's residual streams low‖mid‖high (3H, projected by `fc`) or,
from the second draft step on, the head's own pre-norm output (H); and the embedding of the next
token (the verifier's frozen embedding table, not stored). One Llama decoder layer whose attention
sees cat(input_layernorm(embed), hidden_norm(hidden)) (2H) with `hidden` as the residual; then
`norm` and an LM head over the reduced draft vocabulary, mapped back with `d2t`. It runs through the
same paged-KV forward contract as the decoder LM (batch, cache, backend), in inference and training.
"""

from __future__ import annotations

import torch
from torch import nn

from hsmc.models.config import DecoderConfig
from hsmc.models.decoder import MLP, Attention, LayerContext, RMSNorm, last_positions
from hsmc.ops.backend import Backend, Rope
from hsmc.ops.batch import ForwardBatch
from hsmc.ops.kv_cache import KVCache


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.self_attn = Attention(cfg, layer=0, input_size=2 * h)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        backend = ctx.backend
        x = torch.cat(
            [
                backend.rms_norm(embeds, self.input_layernorm.weight, self.input_layernorm.eps),
                backend.rms_norm(hidden, self.hidden_norm.weight, self.hidden_norm.eps),
            ],
            dim=-1,
        )
        # o_proj consumes its residual (may add into it in place); `hidden` stays the caller's
        stream = self.self_attn(x, ctx, None, residual=hidden.clone())
        return self.mlp(stream, self.post_attention_layernorm, ctx)


class Eagle3Head(nn.Module):
    def __init__(self, cfg: DecoderConfig, draft_vocab_size: int) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.config = self.layer_config = cfg  # replicated under tensor parallelism: every rank holds every head
        self.draft_vocab_size = draft_vocab_size
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))
        self.register_buffer("inv_freq", torch.tensor(cfg.inv_freq, dtype=torch.float32), persistent=False)

    @property
    def rope(self) -> Rope:
        return Rope(self.inv_freq, self.config.rope_attention_scaling)

    def forward(
        self,
        batch: ForwardBatch,
        cache: KVCache,
        backend: Backend,
        *,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        last_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds, hidden [R, T, H] -> (pre-norm output fed to the next step [R, T, H], draft logits [R, T, Vd]);
        with `last_only`, both at each row's last real pair only ([R, 1, ...])."""
        ctx = LayerContext(batch, cache, backend, backend.prepare(batch, self.rope, hidden.dtype))
        out = self.midlayer(embeds, hidden, ctx)
        if last_only:
            out = last_positions(out, batch)
        return out, backend.norm_linear(out, self.norm, self.lm_head)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]
