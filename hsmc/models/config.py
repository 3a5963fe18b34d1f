"""Architecture description of a decoder LM, read from a Hugging Face config.

One dataclass covers Llama (SmolLM2), Qwen2 (q/k/v bias) and Qwen3 (per-head q/k RMSNorm):
they differ only in which biases and norms exist, so the decoder is one implementation
switched by these fields rather than three model files.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from hsmc.errors import ConfigError, UnsupportedArchitectureError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")
_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def check_architecture(model_type: str | None, source: str) -> str:
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"{source}: model_type {model_type!r} is not supported; "
            f"hsmc's decoder implements {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return model_type


@dataclass(frozen=True)
class DecoderConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    max_position_embeddings: int
    inv_freq: tuple[float, ...]
    rope_attention_scaling: float
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(cls, hf_config: Any, source: str = "config") -> DecoderConfig:
        """Translate a transformers `PretrainedConfig`; `source` names it in error messages."""
        model_type = check_architecture(getattr(hf_config, "model_type", None), source)
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise UnsupportedArchitectureError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
        if getattr(hf_config, "use_sliding_window", False):
            raise UnsupportedArchitectureError(f"{source}: use_sliding_window=true is not supported")
        num_heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        inv_freq, attention_scaling = _rope_frequencies(hf_config, head_dim, source)
        eos = getattr(hf_config, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (int(eos),))
        return cls(
            model_type=model_type,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            qkv_bias=True if model_type == "qwen2" else attention_bias,
            o_bias=False if model_type == "qwen2" else attention_bias,
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            max_position_embeddings=hf_config.max_position_embeddings,
            inv_freq=tuple(inv_freq.tolist()),
            rope_attention_scaling=float(attention_scaling),
            eos_token_ids=eos_ids,
        )

    def shard(self, world_size: int, source: str) -> DecoderConfig:
        """The layers one of `world_size` tensor-parallel ranks holds: its attention heads, KV heads and slice of
        the MLP (hidden size and vocabulary stay whole); a ConfigError when one of them does not split evenly."""
        sizes = {
            "attention heads": self.num_heads,
            "KV heads": self.num_kv_heads,
            "intermediate_size": self.intermediate_size,
        }
        for what, n in sizes.items():
            if n % world_size:
                raise ConfigError(
                    f"engine.tensor_parallel={world_size}: {source} has {n} {what}, not divisible by {world_size}"
                )
        return replace(
            self,
            num_heads=self.num_heads // world_size,
            num_kv_heads=self.num_kv_heads // world_size,
            intermediate_size=self.intermediate_size // world_size,
        )


def _rope_frequencies(hf_config: Any, head_dim: int, source: str) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies exactly as transformers computes them for this config.

    Position-independent RoPE types only: dynamic/longrope rescale with the sequence length,
    which would make a token's key depend on how long its row later grows.
    """
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type not in _STATIC_ROPE_TYPES:
        raise UnsupportedArchitectureError(
            f"{source}: rope_type {rope_type!r} is not supported; supported: {', '.join(_STATIC_ROPE_TYPES)}"
        )
    if rope_type == "default":
        base = params["rope_theta"]
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return ROPE_INIT_FUNCTIONS[rope_type](hf_config)
