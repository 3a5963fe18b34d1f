"""The decoder LM: Llama, Qwen2 and Qwen3 in one set of plain modules (gpt-fast style).

Weights are fused where one matmul can replace several: q/k/v into `qkv_proj`, gate/up into
`gate_up_proj`, joined by a load hook and split again by a state-dict hook, so checkpoints keep
transformers' parameter names (`model.layers.0.self_attn.q_proj.weight`, ...) both ways. A layer hands
the residual stream and its modules to the backend, which decides what to fuse (on the GPU a one-row
Linear carries the norm before it and the residual add after it). Numerics follow transformers (RMSNorm
in fp32, RoPE angles in fp32 cast to the activation dtype), so fp32 logits agree to ~1e-5.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hsmc.models.config import DecoderConfig
from hsmc.models.parallel import SINGLE, TensorParallel, VocabParallelEmbedding
from hsmc.ops.backend import Backend, HeadLayout, Rope
from hsmc.ops.batch import ForwardBatch
from hsmc.ops.kv_cache import KVCache


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps


class FusedLinear(nn.Linear):
    """One Linear standing for several that read the same input; checkpoints name the parts.

    `parts` are (name, out_features) in order: loading concatenates `<prefix><name>.weight` (and
    `.bias`) into this module's tensors; `state_dict()` hands them back out under the part names.
    """

    def __init__(self, in_features: int, parts: list[tuple[str, int]], bias: bool) -> None:
        super().__init__(in_features, sum(n for _, n in parts), bias=bias)
        self.parts = parts

    def split_sizes(self, kind: str) -> list[int]:
        """Rows of each part in the fused `kind` tensor."""
        return [n for _, n in self.parts]

    def fuse_hook(self, module: nn.Module, state: dict[str, Any], prefix: str, *args: Any) -> None:
        for kind in ("weight", "bias"):
            keys = [f"{prefix}{name}.{kind}" for name, _ in self.parts]
            if all(k in state for k in keys):
                state[f"{prefix}{self.fused_name}.{kind}"] = torch.cat([state.pop(k) for k in keys])


def _split_state_hook(module: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """state_dict() post-hook: every fused child (FusedLinear, or an Fp8Linear with parts) is written back as
    its named parts."""
    for child_name, child in module.named_children():
        if not getattr(child, "parts", None):
            continue
        for kind in ("weight", "bias", "weight_scale_inv"):
            fused = state.pop(f"{prefix}{child_name}.{kind}", None)
            if fused is None:
                continue
            for (name, _), piece in zip(child.parts, fused.split(child.split_sizes(kind))):
                state[f"{prefix}{name}.{kind}"] = piece


def _register_fused(owner: nn.Module, name: str, fused: FusedLinear) -> None:
    fused.fused_name = name
    owner.add_module(name, fused)
    owner.register_load_state_dict_pre_hook(fused.fuse_hook)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer: int, input_size: int | None = None) -> None:
        """`input_size` differs from hidden_size only in an EAGLE3 head (embedding ‖ hidden, 2H)."""
        super().__init__()
        self.layer = layer
        self.heads = HeadLayout(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        q_size, kv_size, _ = self.heads.sizes
        parts = [("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)]
        _register_fused(self, "qkv_proj", FusedLinear(input_size or cfg.hidden_size, parts, bias=cfg.qkv_bias))
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.register_state_dict_post_hook(_split_state_hook)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: LayerContext, norm: RMSNorm | None, residual: torch.Tensor) -> torch.Tensor:
        """residual + o_proj(attention(qkv_proj(norm(x)))): the stream after this attention block (no norm: x as
        is, an EAGLE3 head's concatenated input)."""
        backend = ctx.backend
        qkv = backend.norm_linear(x, norm, self.qkv_proj) if norm is not None else backend.linear(x, self.qkv_proj)
        qk_norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if hasattr(self, "q_norm") else None
        q = backend.qkv_to_cache(self.layer, qkv, self.heads, qk_norm, ctx.cache, ctx.batch, ctx.meta)
        attended = backend.attend(self.layer, q, ctx.cache, ctx.batch, ctx.meta)
        return ctx.tp.all_reduce(backend.linear(attended, self.o_proj, ctx.tp.lead(residual)))


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        parts = [("gate_proj", cfg.intermediate_size), ("up_proj", cfg.intermediate_size)]
        _register_fused(self, "gate_up_proj", FusedLinear(cfg.hidden_size, parts, bias=cfg.mlp_bias))
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.register_state_dict_post_hook(_split_state_hook)

    def forward(self, stream: torch.Tensor, norm: RMSNorm, ctx: LayerContext) -> torch.Tensor:
        """stream + down_proj(silu(gate) * up) of gate_up_proj(norm(stream)): the stream after this block."""
        gate_up = ctx.backend.norm_linear(stream, norm, self.gate_up_proj)
        return ctx.tp.all_reduce(ctx.backend.silu_linear(gate_up, self.down_proj, ctx.tp.lead(stream)))


@dataclass(frozen=True)
class LayerContext:
    """What every layer needs besides its input, built once per forward."""

    batch: ForwardBatch
    cache: KVCache
    backend: Backend
    meta: Any  # the backend's per-forward metadata
    tp: TensorParallel = SINGLE  # a sharded model's group: o_proj and down_proj all-reduce their partial products


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, stream: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        """The residual stream after this layer."""
        stream = self.self_attn(stream, ctx, self.input_layernorm, residual=stream)
        return self.mlp(stream, self.post_attention_layernorm, ctx)


class Transformer(nn.Module):
    def __init__(self, cfg: DecoderConfig, tp: TensorParallel) -> None:
        """`cfg`: the layers this rank holds (`DecoderConfig.shard`)."""
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


def last_positions(x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """x [R, T, ...] at each row's last real token: [R, 1, ...] (so a prefill computes one row of logits)."""
    idx = (batch.num_new - 1).clamp_min(0).view(-1, 1, *([1] * (x.dim() - 2)))
    return x.gather(1, idx.expand(-1, 1, *x.shape[2:]))


class DecoderLM(nn.Module):
    def __init__(self, cfg: DecoderConfig, tp: TensorParallel = SINGLE, source: str = "the model") -> None:
        """`tp`: the tensor-parallel group whose rank's shard this model holds (`hsmc.models.parallel`); `config`
        stays the whole model's, `layer_config` is what this rank's layers (and KV cache) hold."""
        super().__init__()
        self.config, self.tp = cfg, tp
        self.layer_config = cfg if tp.world_size == 1 else cfg.shard(tp.world_size, source)
        self.model = Transformer(self.layer_config, tp)
        self.lm_head = nn.Linear(cfg.hidden_size, tp.vocab_rows(cfg.vocab_size), bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", torch.tensor(cfg.inv_freq, dtype=torch.float32), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def rope(self) -> Rope:
        return Rope(self.inv_freq, self.config.rope_attention_scaling)

    def forward(
        self,
        batch: ForwardBatch,
        cache: KVCache,
        backend: Backend,
        capture: tuple[int, ...] = (),
        last_only: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the batch's new tokens, writing their KV into `cache`.

        Returns logits [R, T, V] (or [R, 1, V] at each row's last real token with `last_only`) and, when
        `capture` names residual-stream indices in transformers' `hidden_states` numbering (0: the
        embeddings; i: the stream after i decoder layers), those streams as [R, T, len(capture)·H].
        """
        n = self.config.num_layers
        if any(not 0 <= i < n for i in capture):
            raise ValueError(f"capture indices must lie in [0, {n - 1}] for a {n}-layer model, got {capture}")
        stream = self.model.embed_tokens(batch.tokens)
        ctx = LayerContext(batch, cache, backend, backend.prepare(batch, self.rope, stream.dtype), self.tp)
        h = stream.shape[-1]
        features = stream.new_empty(*stream.shape[:-1], len(capture) * h) if capture else None
        for i, layer in enumerate(self.model.layers):
            for j in (j for j, c in enumerate(capture) if c == i):  # copied now: the layer consumes its stream
                features[..., j * h : (j + 1) * h] = stream
            stream = layer(stream, ctx)
        if last_only:
            stream = last_positions(stream, batch)
        logits = backend.norm_linear(stream, self.model.norm, self.lm_head)
        return self.tp.all_gather(logits, self.config.vocab_size), features
