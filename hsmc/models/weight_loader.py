"""Streaming weight loader: safetensors shards straight onto the device, one tensor at a time.

The model is built on the meta device (nothing allocated), every checkpoint key is matched to the
tensor it fills from the shards' headers alone (a missing or unexpected key fails before any data is
read), and then the shards are read one at a time with `safe_open`: each tensor goes to the target
device at once and its CPU copy is dropped, so CPU memory peaks at about one shard (the pages of the
open file) instead of the whole model, which for a 32B model is the difference between 65 GB of RAM and
a few. Fused q/k/v and gate/up weights are assembled on the device as soon as all their parts have
arrived; with `quantize_block` (a level's `dtype: fp8`) each decoder-layer Linear is block-quantized to
FP8 on the device as it arrives; an FP8 checkpoint (Qwen's layout, `hsmc.ops.fp8_linear`) loads as is. A
tensor-parallel rank reads only its slice of each tensor (`hsmc.models.sharding`).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from hsmc.errors import ModelLoadError
from hsmc.models.config import DecoderConfig
from hsmc.models.decoder import DecoderLM
from hsmc.models.parallel import SINGLE, TensorParallel
from hsmc.models.sharding import check_scale_blocks, read_shard
from hsmc.ops.fp8_linear import FP8_DTYPE, Fp8Format, Fp8Linear, layer_linears, quantize_fp8, swap_for_fp8

IGNORED_KEYS = ("rotary_emb.inv_freq",)


@dataclasses.dataclass
class _Target:
    """Where one checkpoint tensor goes: part `index` of `count` of `module`'s parameter `name`."""

    key: str
    module: nn.Module
    name: str
    index: int
    count: int


def layer_index(key: str) -> int:
    """Decoder layer a weight belongs to (-1 for embeddings, final norm and head)."""
    match = re.match(r"model\.layers\.(\d+)\.", key)
    return int(match.group(1)) if match else -1


def header_keys(files: list[Path]) -> dict[str, Path]:
    """Every tensor name of the shards (headers only) and the file holding it."""
    keys: dict[str, Path] = {}
    for f in files:
        try:
            with safe_open(f, "pt") as st:
                keys.update(dict.fromkeys(st.keys(), f))
        except SafetensorError as e:
            raise ModelLoadError(f"{f}: not a readable safetensors file ({e})") from None
    return keys


def fp8_format(folder: Path) -> Fp8Format | None:
    """The checkpoint's FP8 layout from its config.json (None when it is not quantized)."""
    path = folder / "config.json"
    return Fp8Format.from_config(json.loads(path.read_text()), str(path))


@torch.no_grad()
def load_decoder(
    folder: Path,
    files: list[Path],
    cfg: DecoderConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    source: str,
    num_layers: int | None = None,
    quantize_block: tuple[int, int] | None = None,
    tp: TensorParallel = SINGLE,
) -> DecoderLM:
    """A DecoderLM with `dtype` activations on `device` from the shards `files` of `folder`.

    `num_layers` keeps the first n decoder layers; `quantize_block` quantizes an unquantized
    checkpoint's decoder-layer Linears to FP8 with that scale block; `tp`: the tensor-parallel rank whose shard
    to load.
    """
    device = torch.device(device)
    fmt = fp8_format(folder)
    if num_layers is not None:
        if not 0 < num_layers <= cfg.num_layers:
            raise ModelLoadError(f"{source}: num_layers={num_layers} but the model has {cfg.num_layers} layers")
        cfg = dataclasses.replace(cfg, num_layers=num_layers)
    keys = {
        k: f for k, f in header_keys(files).items() if not k.endswith(IGNORED_KEYS) and layer_index(k) < cfg.num_layers
    }
    with torch.device("meta"):
        model = DecoderLM(cfg, tp, source).to(dtype)
    quantized = _use_fp8(model, keys, fmt, quantize_block if fmt is None else None, device, source, tp)
    targets = _targets(model, quantized)
    missing, unexpected = sorted(set(targets) - set(keys)), sorted(set(keys) - set(targets))
    if missing or unexpected:
        raise ModelLoadError(
            f"{source}: weights do not match a {cfg.model_type} model of this config; "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}"
        )
    pending: dict[tuple[int, str], list[torch.Tensor | None]] = {}
    for f in files:
        with safe_open(f, "pt") as st:
            for key in st.keys():
                if key in targets:
                    _place(targets[key], read_shard(st, key, tp).to(device), dtype, pending)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = torch.tensor(cfg.inv_freq, dtype=torch.float32, device=device)
    return model.eval().requires_grad_(False)


def _checkpoint_names(name: str, module: nn.Module, param: str) -> list[str]:
    """The checkpoint keys one parameter is assembled from (its parts' names for a fused module)."""
    parts = getattr(module, "parts", None)
    if not parts:
        return [f"{name}.{param}"]
    owner = name.rpartition(".")[0]
    return [f"{owner}.{part}.{param}" for part, _ in parts]


def _use_fp8(
    model: DecoderLM,
    keys: dict[str, Path],
    fmt: Fp8Format | None,
    quantize_block: tuple[int, int] | None,
    device: torch.device,
    source: str,
    tp: TensorParallel,
) -> set[nn.Module]:
    """Swap each decoder-layer Linear for an Fp8Linear where the checkpoint stores it in FP8 (its weight
    has a `weight_scale_inv`) or where `quantize_block` asks for it; returns the modules quantized here."""
    swapped, quantized = False, set()
    for name in layer_linears(model):
        weights = _checkpoint_names(name, model.get_submodule(name), "weight")
        scaled = [f"{k}_scale_inv" in keys for k in weights]
        if any(scaled) and not all(scaled):
            raise ModelLoadError(f"{source}: only some parts of {name} have a weight_scale_inv")
        if all(scaled) and fmt is None:
            raise ModelLoadError(f"{source}: {weights[0]}_scale_inv found but config.json has no quantization_config")
        block = fmt.block if all(scaled) and fmt is not None else quantize_block
        if block is None:
            continue
        if all(scaled) and tp.world_size > 1:
            check_scale_blocks(name, model.get_submodule(name), block, tp, source)
        fp8 = swap_for_fp8(model, name, block, source)
        swapped = True
        if not all(scaled):
            quantized.add(fp8)
    if swapped and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        raise ModelLoadError(
            f"{source}: FP8 weights need a GPU of compute capability >= 8.9 (Ada, Hopper); "
            f"{torch.cuda.get_device_name(device)} has {major}.{minor}: load a bf16 checkpoint instead"
        )
    return quantized


def _targets(model: DecoderLM, quantized: set[nn.Module]) -> dict[str, _Target]:
    """Checkpoint key -> the parameter (part) it fills; a tied head has no key of its own, and the scales of
    a module quantized at load come from its weight."""
    targets: dict[str, _Target] = {}
    for name, module in model.named_modules():
        if name == "lm_head" and model.config.tie_word_embeddings:
            continue
        for param, value in module._parameters.items():
            if value is None or (module in quantized and param == "weight_scale_inv"):
                continue
            names = _checkpoint_names(name, module, param)
            for i, key in enumerate(names):
                targets[key] = _Target(key, module, param, i, len(names))
    return targets


def _place(
    target: _Target,
    tensor: torch.Tensor,
    dtype: torch.dtype,
    pending: dict[tuple[int, str], list[torch.Tensor | None]],
) -> None:
    """Convert one checkpoint tensor (already on the device) and set its parameter once all parts are in."""
    module = target.module
    if isinstance(module, Fp8Linear) and target.name == "weight" and tensor.dtype != FP8_DTYPE:
        weight, scale = quantize_fp8(tensor, module.block)
        _add_part(target, "weight", weight, pending)
        _add_part(target, "weight_scale_inv", scale, pending)
        return
    if tensor.dtype != FP8_DTYPE:
        tensor = tensor.to(torch.float32 if target.name == "weight_scale_inv" else dtype)
    _add_part(target, target.name, tensor, pending)


def _add_part(
    target: _Target, name: str, tensor: torch.Tensor, pending: dict[tuple[int, str], list[torch.Tensor | None]]
) -> None:
    parts = pending.setdefault((id(target.module), name), [None] * target.count)
    parts[target.index] = tensor
    if any(p is None for p in parts):
        return
    del pending[(id(target.module), name)]
    full = parts[0] if target.count == 1 else torch.cat(parts)  # type: ignore[arg-type]
    expected = getattr(target.module, name).shape
    if full.shape != expected:
        what = "with the other parts of its fused weight " if target.count > 1 else ""
        raise ModelLoadError(f"{target.key} {what}has shape {tuple(full.shape)}, expected {tuple(expected)}")
    setattr(target.module, name, nn.Parameter(full, requires_grad=False))
