"""Build a `DecoderLM` from a local folder, a hub id, a `.gguf` file or a demo model's short name.

Folders hold a Hugging Face `config.json` and safetensors weights (one file or sharded with
`model.safetensors.index.json`). Hub ids go through huggingface_hub's cache. GGUF files are
dequantized once by transformers' GGUF loader into a cached folder (`hsmc.models.gguf`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from hsmc.errors import ModelLoadError
from hsmc.models.config import DecoderConfig, check_architecture
from hsmc.models.decoder import DecoderLM
from hsmc.models.parallel import SINGLE, TensorParallel
from hsmc.models.weight_loader import load_decoder
from hsmc.ops.fp8_linear import QWEN_BLOCK

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# a level's `dtype` -> its activation dtype; "fp8" quantizes the weights at load and computes in bf16
COMPUTE_DTYPES = {**DTYPES, "fp8": torch.bfloat16}
_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]


@dataclass
class LoadedModel:
    model: DecoderLM
    tokenizer: Any | None  # a transformers tokenizer, or None when the source ships none
    source: str


def load_model(
    source: str,
    dtype: str = "float32",
    device: str | torch.device = "cpu",
    num_layers: int | None = None,
    tp: TensorParallel = SINGLE,
) -> LoadedModel:
    """Load weights and tokenizer from `source` (see module docstring) onto `device`, shard by shard
    (`hsmc.models.weight_loader`); `dtype: fp8` quantizes the decoder layers' weights to block-scaled FP8.

    `num_layers` keeps only the first n decoder layers (with the final norm and LM head): a
    layer-truncated copy of a model is a real, cheaper draft for it. `tp`: the tensor-parallel rank whose shard
    to load (`hsmc.models.parallel`).
    """
    from hsmc.models.tokenizer import load_tokenizer

    if dtype not in COMPUTE_DTYPES:
        raise ModelLoadError(f"{source}: dtype {dtype!r} is not one of {', '.join(COMPUTE_DTYPES)}", source)
    try:
        folder = resolve_folder(source)
        model = _load_folder(folder, dtype, device, source, num_layers, tp)
        return LoadedModel(model=model, tokenizer=load_tokenizer(folder), source=source)
    except ModelLoadError as e:
        e.source = e.source or source  # lets the caller name the level(s) that use this model
        raise


def resolve_folder(source: str, weights: bool = True) -> Path:
    """A local folder for `source`: a demo model's short name, a .gguf file (its cached conversion), an
    existing path, or a hub id.

    `weights=False` fetches only a hub model's config and tokenizer files, for checks that must
    not wait for gigabytes of weights.
    """
    from hsmc.models.demo import DEMO_MODELS, demo_model_folder
    from hsmc.models.gguf import converted_gguf

    if source in DEMO_MODELS:
        return demo_model_folder(source)
    if source.endswith(".gguf"):
        return converted_gguf(Path(source))
    if Path(source).exists():
        return Path(source)
    return _download_from_hub(source, weights)


def is_hub_id(source: str) -> bool:
    """Whether `source` names a hub model (not a demo name, a local path or a .gguf file)."""
    from hsmc.models.demo import DEMO_MODELS

    return source not in DEMO_MODELS and not Path(source).exists() and not source.endswith(".gguf")


def _download_from_hub(repo_id: str, weights: bool) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    patterns = _HUB_PATTERNS if weights else [p for p in _HUB_PATTERNS if p != "*.safetensors"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except HFValidationError as e:
        raise ModelLoadError(
            f"model {repo_id!r}: no such local folder or .gguf file, and not a valid hub id ({e})"
        ) from None
    except Exception as e:  # huggingface_hub raises several offline / not-found / auth types
        from huggingface_hub import constants

        offline = " (HF_HUB_OFFLINE=1 is set)" if constants.HF_HUB_OFFLINE else ""
        raise ModelLoadError(
            f"model {repo_id!r}: not a local folder or .gguf file, and the hub id could not be fetched"
            f"{offline} nor found in the cache {constants.HF_HUB_CACHE}: {type(e).__name__}: {e}"
        ) from e


def read_hf_config(folder: Path) -> Any:
    from transformers import AutoConfig

    path = folder / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{folder}: missing config.json")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: not valid JSON ({e})") from None
    check_architecture(config.get("model_type"), str(path))
    return AutoConfig.from_pretrained(folder)


def read_decoder_config(folder: Path) -> DecoderConfig:
    """The architecture in a model folder's config.json (no weights are read)."""
    return DecoderConfig.from_hf(read_hf_config(folder), source=str(folder / "config.json"))


def read_gguf_config(path: Path) -> DecoderConfig:
    """The architecture in a GGUF file's metadata (no tensors are dequantized)."""
    from transformers import AutoConfig

    if not path.is_file():
        raise ModelLoadError(f"GGUF file not found: {path}")
    try:
        hf_config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"{path}: transformers could not read this GGUF file: {e}") from e
    return DecoderConfig.from_hf(hf_config, source=str(path))


def safetensors_files(folder: Path) -> list[Path]:
    """The folder's weight files: the shards its index lists, or every `*.safetensors`."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise ModelLoadError(f"{index}: shard(s) listed but missing: {', '.join(missing)}")
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        present = ", ".join(sorted(p.name for p in folder.iterdir())) or "nothing"
        raise ModelLoadError(f"{folder}: no safetensors weights (found: {present})")
    return files


def _load_folder(
    folder: Path, dtype: str, device: str | torch.device, source: str, num_layers: int | None, tp: TensorParallel
) -> DecoderLM:
    cfg = read_decoder_config(folder)
    quantize = QWEN_BLOCK if dtype == "fp8" else None
    return load_decoder(
        folder, safetensors_files(folder), cfg, COMPUTE_DTYPES[dtype], device, source, num_layers, quantize, tp
    )


def check_safetensors_header(path: Path) -> None:
    """Read only the header of a weight file: a truncated or corrupt file fails here, naming itself."""
    from safetensors import safe_open

    try:
        with safe_open(path, "pt"):
            pass
    except SafetensorError as e:
        raise ModelLoadError(f"{path}: not a readable safetensors file ({e})") from None
