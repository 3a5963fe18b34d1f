"""`HierarchicalDecoder`: the Python entry point, built from a config.

This version runs a one-level stack (`[model]`, autoregressive decoding through the engine);
the level-stack work adds rejection, SMC and EAGLE3 levels behind the same interface.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from hsmc.config import ConfigError, GenerationConfig, HsmcConfig, load_config, validate
from hsmc.engine.generate import AutoregressiveGenerator
from hsmc.engine.kv_pool import BlockTables, SlotAllocator
from hsmc.engine.runner import ModelRunner
from hsmc.models.loading import load_model
from hsmc.models.tokenizer import encode_prompt


@dataclass
class Result:
    text: str
    token_ids: list[int]  # generated ids only
    finish_reason: str  # "stop" or "length"
    stats: dict[str, float]  # new_tokens, seconds (from the generate() call to its last token), tokens_per_s


class HierarchicalDecoder:
    def __init__(self, config: HsmcConfig) -> None:
        self.config = config
        device = torch.device(config.engine.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"engine.device={config.engine.device!r} but no CUDA device is available")
        (level,) = config.levels
        loaded = load_model(level.model, level.dtype, device)
        self.model, self.tokenizer = loaded.model, loaded.tokenizer
        capacity = config.engine.kv_capacity_tokens
        tables = BlockTables(SlotAllocator(capacity, device), config.engine.max_batch_rows, capacity)
        self.runner = ModelRunner(self.model, tables)

    @classmethod
    def from_config(cls, source: str | Path | DictConfig | dict, overrides: Sequence[str] = ()) -> HierarchicalDecoder:
        return cls(load_config(source, overrides))

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        on_finish: Callable[[int], None] | None = None,
        **generation_overrides: Any,
    ) -> list[Result]:
        """Complete `prompts` (texts, chat-templated if configured, or token-id lists used as is)."""
        gen = self._generation_config(generation_overrides)
        ids = [encode_prompt(self.tokenizer, p, gen.chat_template) for p in prompts]
        stop = () if gen.ignore_eos else self.model.config.eos_token_ids
        (level,) = self.config.levels
        generator = AutoregressiveGenerator(self.runner, level.temperature, gen.seed)
        finished_at: dict[int, float] = {}
        start = time.perf_counter()

        def finished(i: int) -> None:
            finished_at[i] = time.perf_counter() - start
            if on_finish:
                on_finish(i)

        completions = generator.generate(ids, gen.max_new_tokens, stop, finished)
        results = []
        for i, c in enumerate(completions):
            seconds = finished_at[i]
            text = self.tokenizer.decode(c.token_ids, skip_special_tokens=True) if self.tokenizer else ""
            stats = {"new_tokens": len(c.token_ids), "seconds": seconds, "tokens_per_s": len(c.token_ids) / seconds}
            results.append(Result(text=text, token_ids=c.token_ids, finish_reason=c.finish_reason, stats=stats))
        return results

    def _generation_config(self, overrides: dict[str, Any]) -> GenerationConfig:
        known = {f.name for f in dataclasses.fields(GenerationConfig)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ConfigError(f"generate(): unknown generation option(s) {unknown}; known: {sorted(known)}")
        gen = dataclasses.replace(self.config.generation, **overrides)
        validate(dataclasses.replace(self.config, generation=gen), "generate()")
        return gen
