"""Build a `DecoderLM` from a local folder, a hub id, a `.gguf` file or a demo model's short name.

Folders hold a Hugging Face `config.json` and safetensors weights (one file or sharded with
`model.safetensors.index.json`). Hub ids go through huggingface_hub's cache. GGUF files are
dequantized once by transformers' GGUF loader into a cached folder (`hsmc.models.gguf`).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hsmc.errors import ModelLoadError
from hsmc.models.config import DecoderConfig, check_architecture
from hsmc.models.decoder import DecoderLM

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
_IGNORED_KEYS = ("rotary_emb.inv_freq",)


@dataclass
class LoadedModel:
    model: DecoderLM
    tokenizer: Any | None  # a transformers tokenizer, or None when the source ships none
    source: str


def load_model(
    source: str, dtype: str = "float32", device: str | torch.device = "cpu", num_layers: int | None = None
) -> LoadedModel:
    """Load weights and tokenizer from `source` (see module docstring) onto `device`.

    `num_layers` keeps only the first n decoder layers (with the final norm and LM head): a
    layer-truncated copy of a model is a real, cheaper draft for it.
    """
    from hsmc.models.tokenizer import load_tokenizer

    if dtype not in DTYPES:
        raise ModelLoadError(f"{source}: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    folder = resolve_folder(source)
    model = _load_folder(folder, DTYPES[dtype], device, source, num_layers)
    return LoadedModel(model=model, tokenizer=load_tokenizer(folder), source=source)


def resolve_folder(source: str) -> Path:
    """A local folder for `source`: a demo model's short name, a .gguf file (its cached conversion), an existing
    path, or a hub id."""
    from hsmc.models.demo import DEMO_MODELS, demo_model_folder
    from hsmc.models.gguf import converted_gguf

    if source in DEMO_MODELS:
        return demo_model_folder(source)
    if source.endswith(".gguf"):
        return converted_gguf(Path(source))
    if Path(source).exists():
        return Path(source)
    return _download_from_hub(source)


def _download_from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS))
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
    check_architecture(json.loads(path.read_text()).get("model_type"), str(path))
    return AutoConfig.from_pretrained(folder)


def _safetensors_files(folder: Path) -> list[Path]:
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
    folder: Path, dtype: torch.dtype, device: str | torch.device, source: str, num_layers: int | None
) -> DecoderLM:
    from safetensors.torch import load_file

    cfg = DecoderConfig.from_hf(read_hf_config(folder), source=str(folder / "config.json"))
    state: dict[str, torch.Tensor] = {}
    for f in _safetensors_files(folder):
        state.update(load_file(f))
    return build_model(cfg, state, dtype, device, source, num_layers)


def _layer_index(key: str) -> int:
    """Decoder layer a weight belongs to (-1 for embeddings, final norm and head)."""
    match = re.match(r"model\.layers\.(\d+)\.", key)
    return int(match.group(1)) if match else -1


def build_model(
    cfg: DecoderConfig,
    state: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: str | torch.device,
    source: str,
    num_layers: int | None = None,
) -> DecoderLM:
    """Instantiate without initializing (meta device) and adopt the given tensors."""
    state = {k: v for k, v in state.items() if not k.endswith(_IGNORED_KEYS)}
    if num_layers is not None:
        if not 0 < num_layers <= cfg.num_layers:
            raise ModelLoadError(f"{source}: num_layers={num_layers} but the model has {cfg.num_layers} layers")
        cfg = dataclasses.replace(cfg, num_layers=num_layers)
        state = {k: v for k, v in state.items() if _layer_index(k) < num_layers}
    if cfg.tie_word_embeddings and "model.embed_tokens.weight" in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    with torch.device("meta"):
        model = DecoderLM(cfg)
    expected = set(model.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        raise ModelLoadError(
            f"{source}: weights do not match a {cfg.model_type} model of this config; "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = torch.tensor(cfg.inv_freq, dtype=torch.float32, device=device)
    return model.eval().requires_grad_(False)
