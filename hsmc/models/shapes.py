"""Real model shapes with random weights, for measuring speed where the checkpoints are not at hand.

Decode speed depends on the shapes (bytes read per step), not on the weight values, so a benchmark
of a random model of Qwen3-8B's exact shape measures what Qwen3-8B would run at. Weights are drawn on
the target device directly (normal, std 0.02; norms 1), never zeros (METHOD.md: zeros can time faster).
A config level names one as `model: random:qwen3-8b` (an `eagle3` level: a head shaped for that verifier);
levels naming the same source share one model, so a self-draft is two levels with the same name.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from hsmc.errors import ConfigError
from hsmc.models.config import DecoderConfig
from hsmc.models.decoder import DecoderLM
from hsmc.models.loading import COMPUTE_DTYPES, LoadedModel
from hsmc.models.parallel import SINGLE, TensorParallel
from hsmc.ops.fp8_linear import QWEN_BLOCK, layer_linears, quantize_fp8, swap_for_fp8

RANDOM_PREFIX = "random:"

_QWEN3 = dict(
    model_type="qwen3",
    vocab_size=151936,
    head_dim=128,
    num_key_value_heads=8,
    rms_norm_eps=1e-6,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    eos_token_id=151645,
)

SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(
        _QWEN3,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        tie_word_embeddings=True,
    ),
    "qwen3-8b": dict(
        _QWEN3,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        tie_word_embeddings=False,
    ),
    "qwen3-14b": dict(
        _QWEN3,
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=40,
        num_attention_heads=40,
        tie_word_embeddings=False,
    ),
    "qwen3-32b": dict(
        _QWEN3,
        hidden_size=5120,
        intermediate_size=25600,
        num_hidden_layers=64,
        num_attention_heads=64,
        tie_word_embeddings=False,
    ),
    "llama-3.1-8b": dict(
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        tie_word_embeddings=False,
        eos_token_id=128009,
    ),
}


def random_shape(source: str) -> str | None:
    """The shape a `random:NAME` model source names; None for any other source."""
    if not source.startswith(RANDOM_PREFIX):
        return None
    name = source[len(RANDOM_PREFIX) :]
    if name not in SHAPES:
        raise ConfigError(f"model {source!r}: unknown shape {name!r}; known: {', '.join(SHAPES)}")
    return name


def random_loaded(
    shape: str, dtype: str, device: torch.device | str, num_layers: int | None = None, tp: TensorParallel = SINGLE
) -> LoadedModel:
    """A level's model of a named shape with random weights (no tokenizer); `num_layers` keeps the first n;
    dtype `fp8` gives the layout of Qwen's FP8 releases; `tp`: the tensor-parallel rank whose shard to draw."""
    cfg = DecoderConfig.from_hf(hf_config(shape), source=RANDOM_PREFIX + shape)
    if num_layers is not None:
        if not 0 < num_layers <= cfg.num_layers:
            raise ConfigError(f"{RANDOM_PREFIX}{shape}: num_layers={num_layers} but the shape has {cfg.num_layers}")
        cfg = dataclasses.replace(cfg, num_layers=num_layers)
    model = random_model(cfg, COMPUTE_DTYPES[dtype], device, fp8=dtype == "fp8", tp=tp)
    return LoadedModel(model, None, RANDOM_PREFIX + shape)


def hf_config(shape: str) -> Any:
    """The transformers config of a named shape."""
    from transformers import AutoConfig

    return AutoConfig.for_model(**SHAPES[shape])


@torch.no_grad()
def random_model(
    config: DecoderConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int = 0,
    fp8: bool = False,
    tp: TensorParallel = SINGLE,
) -> DecoderLM:
    """A DecoderLM of `config`'s shape with random weights drawn on `device`; `fp8` stores the decoder
    layers' Linears as Qwen's FP8 releases do (e4m3 + a scale per 128x128 block, bf16 elsewhere), each
    quantized from its random `dtype` weight. A tensor-parallel rank (`tp`) draws its shard's shapes from the
    same seed: a random model all the same, for timing."""
    with torch.device("meta"):
        model = DecoderLM(config, tp).to(dtype)  # cast on meta: nothing is allocated in fp32 first
    fp8_modules = (
        [swap_for_fp8(model, name, QWEN_BLOCK, "random model") for name in layer_linears(model)] if fp8 else []
    )
    model = model.to_empty(device=device)
    generator = torch.Generator(device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif p.dtype == dtype:
            p.normal_(0.0, 0.02, generator=generator)
    for module in fp8_modules:  # one module at a time: the dense weight exists only while it is quantized
        dense = torch.empty(module.weight.shape, dtype=dtype, device=device).normal_(0.0, 0.02, generator=generator)
        weight, scale = quantize_fp8(dense, module.block)
        module.weight.copy_(weight)
        module.weight_scale_inv.copy_(scale)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = torch.tensor(config.inv_freq, dtype=torch.float32, device=device)
    return model.eval().requires_grad_(False)
