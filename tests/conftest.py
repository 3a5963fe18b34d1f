"""Shared fixtures: tiny random models of each architecture saved as Hugging Face folders,
and the real SmolLM2-135M demo model (fetched once into the hsmc cache)."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before huggingface_hub is imported anywhere
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from pathlib import Path

import pytest
import torch

if "PYTEST_XDIST_WORKER_COUNT" in os.environ:  # `pytest -n W`: the workers share the cores, none spins on all
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))
if not torch.cuda.is_available():  # Triton kernels then run (and are tested) through Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY_CONFIGS = {
    "llama": dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        vocab_size=101,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        attention_bias=False,
        eos_token_id=2,
        bos_token_id=1,
    ),
    "qwen2": dict(
        model_type="qwen2",
        architectures=["Qwen2ForCausalLM"],
        vocab_size=97,
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        eos_token_id=2,
    ),
    "qwen3": dict(
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        vocab_size=89,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        max_position_embeddings=256,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        eos_token_id=2,
    ),
}


def make_tiny_model(arch: str, folder: Path, seed: int = 0, **overrides) -> Path:
    """Save a randomly initialised tiny model of `arch` with transformers' own classes.

    Every parameter is drawn at a scale that makes logits far from uniform (norm weights near 1),
    so a wrong bias, norm or rotation shows up as a large logit error.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**{**TINY_CONFIGS[arch], **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 0.2 if "embed" in name or "bias" in name else 0.15)
    model.save_pretrained(folder)
    return folder


def save_tokenizer(folder: Path, tokens: list[str], eos: str | None = None) -> Path:
    """Save a byte-level BPE tokenizer next to a tiny model: token i is `tokens[i]`, written in GPT-2's byte
    alphabet ("a" is the byte a; `ByteLevel.alphabet()` covers all 256), so generated ids decode to text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from hsmc.models.demo import demo_model_folder

    return demo_model_folder("smollm2-135m-instruct")
