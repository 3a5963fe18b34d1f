"""The decoder LM: Llama, Qwen2 and Qwen3 in one set of plain modules (gpt-fast style).

Parameter names follow transformers' (`model.layers.0.self_attn.q_proj.weight`, ...) so a
safetensors state dict loads as is. Numerics follow transformers too (RMSNorm in fp32, RoPE
frequencies in fp32 cast to the activation dtype), so fp32 logits agree to ~1e-5.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from hsmc.models.config import DecoderConfig
from hsmc.ops.attention import AttentionBackend
from hsmc.ops.batch import ForwardBatch
from hsmc.ops.kv_cache import KVCache


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


@dataclass(frozen=True)
class LayerContext:
    """What every layer needs besides its input, built once per forward."""

    batch: ForwardBatch
    cache: KVCache
    backend: AttentionBackend
    attn_meta: object  # the backend's per-batch metadata
    rope: tuple[torch.Tensor, torch.Tensor]  # cos, sin [R, T, 1, D]


def rope_cos_sin(
    inv_freq: torch.Tensor, scale: float, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [R, T, 1, D] computed like transformers: fp32 angles, scaled, cast to `dtype`."""
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer: int, input_size: int | None = None) -> None:
        """`input_size` differs from hidden_size only in an EAGLE3 head (embedding ‖ hidden, 2H)."""
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        d_in = input_size or cfg.hidden_size
        self.q_proj = nn.Linear(d_in, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(d_in, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(d_in, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        r, t, _ = x.shape
        q = self.q_proj(x).view(r, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(r, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(r, t, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = ctx.rope
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out = ctx.backend.attend(self.layer, q, k, v, ctx.cache, ctx.batch, ctx.attn_meta)
        return self.o_proj(out.reshape(r, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


@dataclass(frozen=True)
class ForwardOutput:
    hidden: torch.Tensor  # [R, T, H] after the final norm
    captured: torch.Tensor | None  # [R, T, len(capture), H]: residual stream at the requested indices


class DecoderLM(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Transformer(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", torch.tensor(cfg.inv_freq, dtype=torch.float32), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def forward(
        self,
        batch: ForwardBatch,
        cache: KVCache,
        backend: AttentionBackend,
        capture: tuple[int, ...] = (),
    ) -> ForwardOutput:
        """Run the batch's new tokens, writing their KV into `cache`.

        `capture` lists residual-stream indices in transformers' `hidden_states` convention:
        0 is the embedding output, i (1 <= i < num_layers) the stream after i decoder layers.
        """
        n = self.config.num_layers
        if any(not 0 <= i < n for i in capture):
            raise ValueError(f"capture indices must lie in [0, {n - 1}] for a {n}-layer model, got {capture}")
        x = self.model.embed_tokens(batch.tokens)
        rope = rope_cos_sin(self.inv_freq, self.config.rope_attention_scaling, batch.positions, x.dtype)
        ctx = LayerContext(batch, cache, backend, backend.prepare(batch), rope)
        captured = [x] if 0 in capture else []
        for i, layer in enumerate(self.model.layers, start=1):
            x = layer(x, ctx)
            if i in capture:
                captured.append(x)
        by_index = dict(zip(sorted(set(capture)), captured))
        stacked = torch.stack([by_index[i] for i in capture], dim=2) if capture else None
        return ForwardOutput(hidden=self.model.norm(x), captured=stacked)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
