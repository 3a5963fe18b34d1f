"""Checks that need no weights, run before a stack loads: a bad model source, prompt or KV budget
then fails in a second instead of after minutes of loading (a 32B model takes minutes).

Each level's `config.json` is read (for a hub id, without downloading its weights), the headers of
local weight files are read (a truncated file fails here, named), the prompts are tokenized with
the tokenizer the stack will use, and each prompt is checked to fit the KV pools on its own (with
`engine.kv_capacity_tokens: auto`, from the memory free now less the weights the configs describe).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from hsmc.config import GenerationConfig, HsmcConfig, LevelConfig, level_label
from hsmc.engine.kv_sizing import GIB, free_memory, stack_capacity, with_rows
from hsmc.engine.ranks import check_world
from hsmc.engine.scheduler import Admission, rows_and_lookahead
from hsmc.errors import ConfigError, ModelLoadError, PromptError
from hsmc.models.config import DecoderConfig
from hsmc.models.decoder import DecoderLM
from hsmc.models.loading import (
    COMPUTE_DTYPES,
    DTYPES,
    check_safetensors_header,
    is_hub_id,
    read_decoder_config,
    read_gguf_config,
    resolve_folder,
    safetensors_files,
)
from hsmc.models.parallel import TensorParallel
from hsmc.models.shapes import SHAPES, hf_config, random_shape
from hsmc.models.size import weight_bytes
from hsmc.models.tokenizer import encode_prompt, load_tokenizer
from hsmc.models.weight_loader import fp8_format
from hsmc.ops.fp8_linear import QWEN_BLOCK, layer_linears, swap_for_fp8
from hsmc.prompts import Prompt


def check_before_loading(cfg: HsmcConfig, prompts: Sequence[Prompt]) -> list[list[int]]:
    """Everything about a run of `prompts` that can fail without weights; returns their token ids."""
    check_world(cfg.engine.tensor_parallel, cfg.engine.device)
    for i, level in enumerate(cfg.levels):
        try:
            _check_level(level, cfg.engine.tensor_parallel)
        except ModelLoadError as e:
            raise type(e)(f"{level_label(i, level)}: {e}", e.source) from None
        except ConfigError as e:
            raise ConfigError(f"{level_label(i, level)}: {e}") from None
    tokenizer = _stack_tokenizer(cfg)
    check_stop_strings(cfg.generation, tokenizer)
    ids = prompt_token_ids(tokenizer, prompts, cfg.generation.chat_template)
    rows, lookahead = rows_and_lookahead(cfg)
    cfg, capacity = estimated_sizes(cfg)
    admission = Admission(cfg.engine.max_batch_rows, capacity, lookahead)
    admission.check([len(p) for p in ids], [cfg.generation.max_new_tokens] * len(ids), [rows] * len(ids))
    return ids


def estimated_sizes(cfg: HsmcConfig) -> tuple[HsmcConfig, int]:
    """`cfg` with its rows a number (`with_rows`) and the KV slots: engine.kv_capacity_tokens, or for "auto" the
    slots left beside the weights as the configs size them (models built on the meta device: shapes and dtypes,
    no data), from the memory free now."""
    rows, capacity = cfg.engine.resolved_max_batch_rows, cfg.engine.resolved_kv_capacity
    if isinstance(capacity, int) and isinstance(rows, int):
        return with_rows(cfg, [], 0), capacity
    weights: dict[tuple[str, str, int | None], int] = {}  # levels naming the same model share its weights
    modules = [_meta_module(level, cfg.engine.tensor_parallel) for level in cfg.levels]
    for level, module in zip(cfg.levels, modules):
        weights[(level.model, level.dtype, level.num_layers)] = weight_bytes(module)
    total = sum(weights.values())
    free = free_memory(torch.device(cfg.engine.device)) - total
    cfg = with_rows(cfg, modules, free)
    if isinstance(capacity, int):
        return cfg, capacity
    return cfg, stack_capacity(cfg, modules, free, f"estimated free after {total / GIB:.1f} GiB of weights")


def _meta_module(level: LevelConfig, tensor_parallel: int = 1) -> torch.nn.Module:
    """The level's model (or EAGLE3 head) on the meta device, with FP8 Linears where it will have them; a decoder
    as one of `tensor_parallel` ranks holds it (a head is whole on every rank)."""
    shape = random_shape(level.model)  # random weights of a named shape (for an eagle3 level: its verifier's)
    if level.kind == "eagle3":
        from hsmc.eagle.checkpoint import head_from_config, new_head_config, read_head_config

        if shape is not None:
            config = new_head_config(SHAPES[shape], min(32000, SHAPES[shape]["vocab_size"]))
        else:
            config = read_head_config(resolve_folder(level.model, weights=False))
        return head_from_config(config).to(DTYPES[level.dtype])
    config = _decoder_config(level.model)
    if level.num_layers is not None:
        config = dataclasses.replace(config, num_layers=level.num_layers)
    with torch.device("meta"):
        model = DecoderLM(config, TensorParallel(0, tensor_parallel), level.model).to(COMPUTE_DTYPES[level.dtype])
    local = shape is None and not level.model.endswith(".gguf")
    fmt = fp8_format(resolve_folder(level.model, weights=False)) if local else None
    block = fmt.block if fmt is not None else (QWEN_BLOCK if level.dtype == "fp8" else None)
    if block is not None:
        for name in layer_linears(model):
            swap_for_fp8(model, name, block, level.model)
    return model


def prompt_token_ids(tokenizer: Any | None, prompts: Sequence[Prompt], chat_template: bool) -> list[list[int]]:
    """Token ids of every prompt; an empty one is named by its index (every stack takes one-token prompts)."""
    if not prompts:
        raise PromptError("no prompts to decode")
    ids = [encode_prompt(tokenizer, p, chat_template) for p in prompts]
    for i, (prompt, tokens) in enumerate(zip(prompts, ids)):
        if not tokens:
            raise PromptError(f"prompt {i} ({prompt!r:.40}) has no tokens")
    return ids


def check_stop_strings(generation: GenerationConfig, tokenizer: Any | None) -> None:
    if generation.stop and tokenizer is None:
        raise ConfigError("generation.stop needs a tokenizer, and this model folder ships none")


def _check_level(level: LevelConfig, tensor_parallel: int) -> None:
    """The level's model exists and is one hsmc can build (split over `tensor_parallel` ranks), and its local
    weight files are readable."""
    if random_shape(level.model) is not None:  # random weights of a named shape: nothing to read
        if level.kind != "eagle3":
            _decoder_config(level.model).shard(tensor_parallel, level.model)
        return
    if level.kind == "eagle3":
        from hsmc.eagle.checkpoint import read_head_config

        folder = resolve_folder(level.model, weights=False)
        read_head_config(folder)
        if not is_hub_id(level.model):
            for f in sorted(folder.glob("*.safetensors")):
                check_safetensors_header(f)
        return
    model = _decoder_config(level.model)
    model.shard(tensor_parallel, level.model)
    if level.num_layers is not None and level.num_layers > model.num_layers:
        raise ConfigError(f"num_layers={level.num_layers}, but {level.model} has {model.num_layers} layers")


def _decoder_config(source: str) -> DecoderConfig:
    if (shape := random_shape(source)) is not None:  # random weights of a named shape
        return DecoderConfig.from_hf(hf_config(shape))
    if source.endswith(".gguf"):
        return read_gguf_config(Path(source))
    folder = resolve_folder(source, weights=False)
    config = read_decoder_config(folder)
    if not is_hub_id(source):  # a hub model's weights are not fetched yet
        for f in safetensors_files(folder):
            check_safetensors_header(f)
    return config


def _stack_tokenizer(cfg: HsmcConfig) -> Any | None:
    """The tokenizer the built stack uses: the top-most level's model that ships one."""
    for level in reversed(cfg.levels):
        if level.kind == "eagle3" or random_shape(level.model) is not None:
            continue
        if level.model.endswith(".gguf"):
            path = Path(level.model)
            return load_tokenizer(path.parent, gguf_file=path.name)
        tokenizer = load_tokenizer(resolve_folder(level.model, weights=False))
        if tokenizer is not None:
            return tokenizer
    return None
