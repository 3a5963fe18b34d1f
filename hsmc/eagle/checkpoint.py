"""EAGLE3 head checkpoints in the published layout, read and written exactly.

`config.json`: a Llama config with `architectures: ["LlamaForCausalLMEagle3"]` (the alias
`Eagle3LlamaForCausalLM` is accepted), `num_hidden_layers: 1`, `draft_vocab_size`,
`tie_word_embeddings: false` and the verifier's rope settings. Weights (`model.safetensors`, or a
`pytorch_model.bin` as some published heads ship): `fc.weight`, `midlayer.self_attn.{q,k,v,o}_proj.weight`,
`midlayer.mlp.{gate,up,down}_proj.weight`, `midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight`,
`norm.weight`, `lm_head.weight`, `d2t` (int64 offsets), `t2d` (bool mask) — no `model.` prefix, no
embeddings (the verifier's are used). Any other key, a missing key or a wrong shape is an error that
names it: a loader that silently skips keys is how a head ends up "emitting garbage".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from hsmc.eagle.head import Eagle3Head
from hsmc.errors import ModelLoadError
from hsmc.models.config import DecoderConfig
from hsmc.models.loading import DTYPES, resolve_folder

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
_VERIFIER_KEYS = (
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
    "rope_parameters", "rope_theta", "rope_scaling", "max_position_embeddings", "vocab_size", "hidden_act",
)  # fmt: skip


def capture_layers(head_config: dict[str, Any], verifier_layers: int) -> tuple[int, int, int]:
    """Residual-stream indices (transformers' hidden_states numbering) the head reads.

    Default 2, N//2, N-3 as SGLang/SpecForge capture them (the stream entering those layers). A
    config's `eagle_aux_hidden_state_layer_ids` name layer *outputs*, so id k is hidden_states[k+1]
    (SGLang's `layers_to_capture = [k + 1 for k in ids]`).
    """
    ids = head_config.get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        return (2, verifier_layers // 2, verifier_layers - 3)
    if len(ids) != 3 or not all(0 <= k < verifier_layers - 1 for k in ids):
        raise ModelLoadError(f"eagle_aux_hidden_state_layer_ids={ids} does not fit a {verifier_layers}-layer verifier")
    return tuple(k + 1 for k in ids)  # type: ignore[return-value]


def new_head_config(verifier_config: dict[str, Any], draft_vocab_size: int) -> dict[str, Any]:
    """config.json of a fresh head for a verifier (its sizes and rope settings)."""
    cfg = {k: verifier_config[k] for k in _VERIFIER_KEYS if k in verifier_config}
    return {
        **cfg,
        "architectures": [ARCHITECTURES[0]],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "draft_vocab_size": draft_vocab_size,
        "tie_word_embeddings": False,
    }


def head_from_config(config: dict[str, Any]) -> Eagle3Head:
    """An uninitialised head (meta tensors) for `config`."""
    from transformers import LlamaConfig

    cfg = DecoderConfig.from_hf(LlamaConfig(**{**config, "model_type": "llama"}), source="EAGLE3 config")
    with torch.device("meta"):
        return Eagle3Head(cfg, int(config["draft_vocab_size"]))


def random_eagle3_head(
    verifier_shape: dict[str, Any], dtype: str, device: torch.device | str, draft_vocab_size: int = 32000
) -> tuple[Eagle3Head, dict[str, Any]]:
    """A head with random weights for a verifier of `verifier_shape` (a `hsmc.models.shapes` entry), drafting
    the first `draft_vocab_size` tokens (32000 like the published Qwen3-8B heads): for timing, not drafting."""
    draft_vocab_size = min(draft_vocab_size, verifier_shape["vocab_size"])
    config = new_head_config(verifier_shape, draft_vocab_size)
    head = head_from_config(config).to(DTYPES[dtype]).to_empty(device=device)
    generator = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=generator)
        head.d2t.zero_()  # draft id i is target id i
        head.t2d.copy_(torch.arange(head.t2d.shape[0], device=device) < draft_vocab_size)
    head.inv_freq = torch.tensor(head.config.inv_freq, dtype=torch.float32, device=device)
    return head.eval().requires_grad_(False), config


def read_head_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{folder}: missing config.json")
    config = json.loads(path.read_text())
    arch = config.get("architectures") or []
    if not any(a in ARCHITECTURES for a in arch):
        raise ModelLoadError(f"{path}: architectures {arch} is not an EAGLE3 head ({' or '.join(ARCHITECTURES)})")
    for key in ("draft_vocab_size", "hidden_size", "vocab_size"):
        if key not in config:
            raise ModelLoadError(f"{path}: missing {key!r}")
    if config.get("num_hidden_layers", 1) != 1:
        raise ModelLoadError(f"{path}: num_hidden_layers={config['num_hidden_layers']}, an EAGLE3 head has 1")
    return config


def load_eagle3_head(
    source: str, dtype: str = "float32", device: str | torch.device = "cpu"
) -> tuple[Eagle3Head, dict[str, Any]]:
    """Load a head from a folder or hub id; returns it with its config dict."""
    from safetensors.torch import load_file

    folder = resolve_folder(source)
    config = read_head_config(folder)
    files = sorted(folder.glob("*.safetensors"))
    if files:
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(f))
    elif (folder / "pytorch_model.bin").is_file():
        state = torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ModelLoadError(f"{folder}: no model.safetensors or pytorch_model.bin")
    head = head_from_config(config)
    expected = head.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise ModelLoadError(f"{folder}: not the EAGLE3 key layout; missing {missing}, unexpected {unexpected}")
    for key, value in state.items():
        if tuple(value.shape) != tuple(expected[key].shape):
            raise ModelLoadError(
                f"{folder}: {key} has shape {tuple(value.shape)}, expected {tuple(expected[key].shape)}"
            )
    float_dtype = DTYPES[dtype]
    state = {k: v.to(device=device, dtype=v.dtype if k in ("d2t", "t2d") else float_dtype) for k, v in state.items()}
    state["d2t"], state["t2d"] = state["d2t"].to(torch.int64), state["t2d"].to(torch.bool)
    head.load_state_dict(state, strict=True, assign=True)
    head.inv_freq = torch.tensor(head.config.inv_freq, dtype=torch.float32, device=device)
    return head.eval().requires_grad_(False), config


def save_eagle3_head(
    head: Eagle3Head, config: dict[str, Any], folder: str | Path, dtype: torch.dtype | None = None
) -> Path:
    """Write config.json and model.safetensors in the published layout; `dtype`: the floating tensors' (None: as
    they are), named in config.json's `torch_dtype`."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if dtype is not None:
        config = {**config, "torch_dtype": str(dtype).removeprefix("torch.")}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    # the fused q/k/v and gate/up weights come out of state_dict() as views: give each key its own storage
    state = {
        k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().cpu().clone()
        for k, v in head.state_dict().items()
    }
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    return folder
