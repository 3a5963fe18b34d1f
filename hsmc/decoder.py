"""`HierarchicalDecoder`: the Python entry point, built from a config.

It loads the level stack, admits prompts in waves that fit the KV pools, and drives the top
level: an `smc` top decodes groups of N particles per prompt; any other top streams tokens.
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

from hsmc.config import GenerationConfig, HsmcConfig, load_config, validate
from hsmc.engine.host_io import PendingRead, upload
from hsmc.engine.scheduler import plan_waves
from hsmc.errors import ConfigError
from hsmc.levels.stack import build_stack
from hsmc.models.loading import LoadedModel
from hsmc.models.tokenizer import encode_prompt
from hsmc.stopping import StopCriteria


@dataclass
class Completion:
    token_ids: list[int]  # generated ids only, the stop token included
    finish_reason: str  # "stop" (a stop token) or "length"


@dataclass
class Result:
    text: str
    token_ids: list[int]  # generated ids only
    finish_reason: str  # "stop" or "length"
    stats: dict[str, Any]  # new_tokens, seconds (generate() start to its last token), tokens_per_s, levels


class HierarchicalDecoder:
    def __init__(self, config: HsmcConfig, models: dict[str, LoadedModel] | None = None) -> None:
        """`models` supplies already-built models by the `model` string a level names (e.g. random weights
        of a real shape for `hsmc bench`); every other level loads its model as usual."""
        self.config = config
        self.stack = build_stack(config, models or {})
        self.tokenizer = self.stack.tokenizer

    @classmethod
    def from_config(cls, source: str | Path | DictConfig | dict, overrides: Sequence[str] = ()) -> HierarchicalDecoder:
        return cls(load_config(source, overrides))

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        on_finish: Callable[[int], None] | None = None,
        **generation_overrides: Any,
    ) -> list[Result]:
        """Complete `prompts` (texts, chat-templated if configured, or token-id lists used as is)."""
        gen = self._generation_config(generation_overrides)
        ids = [encode_prompt(self.tokenizer, p, gen.chat_template) for p in prompts]
        if not ids or any(len(i) == 0 for i in ids):
            raise ValueError("every prompt needs at least one token")
        if gen.stop and self.tokenizer is None:
            raise ConfigError("generation.stop needs a tokenizer, and this model folder ships none")
        eos = frozenset() if gen.ignore_eos else frozenset(self.stack.eos_token_ids)
        stop = StopCriteria(eos, tuple(gen.stop), self.tokenizer)
        self.stack.generator.manual_seed(gen.seed)
        for level in self.stack.levels:
            level.reset_stats()
        engine = self.config.engine
        waves = plan_waves(
            [len(i) for i in ids],
            gen.max_new_tokens,
            engine.max_batch_rows,
            engine.kv_capacity_tokens,
            self.stack.rows_per_prompt,
            self.stack.lookahead,
        )
        finished_at: dict[int, float] = {}
        start = time.perf_counter()
        completions: list[Completion] = []
        for wave in waves:

            def finished(j: int, wave: list[int] = wave) -> None:
                finished_at[wave[j]] = time.perf_counter() - start
                if on_finish:
                    on_finish(wave[j])

            wave_ids = [ids[i] for i in wave]
            if self.stack.is_smc:
                groups = self.stack.top.run(wave_ids, gen.max_new_tokens, stop, finished)
                completions += [Completion(g.token_ids, g.finish_reason) for g in groups]
            else:
                completions += self._stream_wave(wave_ids, gen.max_new_tokens, stop, finished)
        total = time.perf_counter() - start
        level_stats = self._level_stats(total)
        results = []
        for i, c in enumerate(completions):
            seconds = finished_at[i]
            text = stop.trim(self.tokenizer.decode(c.token_ids, skip_special_tokens=True)) if self.tokenizer else ""
            stats = {
                "new_tokens": len(c.token_ids),
                "seconds": seconds,
                "tokens_per_s": len(c.token_ids) / seconds,
                "levels": level_stats,
            }
            results.append(Result(text=text, token_ids=c.token_ids, finish_reason=c.finish_reason, stats=stats))
        return results

    def _stream_wave(
        self, prompts: list[list[int]], max_new_tokens: int, stop: StopCriteria, finished: Callable[[int], None]
    ) -> list[Completion]:
        """Decode rows from a non-SMC top level: each step runs one round for every unfinished row and hands
        over all the tokens it produced. The host reads a step's tokens (one copy) while the next step
        already runs, so stop checks overlap with the GPU; a row that finished is released one step later
        and the tokens of its extra step are dropped."""
        top = self.stack.top
        device = top.state.seq.device
        rows = upload(torch.arange(len(prompts)), device)
        top.load_prompts(rows, prompts)
        top.set_len_bound(max(len(p) for p in prompts))
        completions = [Completion([], "length") for _ in prompts]
        lengths = [len(p) for p in prompts]  # each row's sequence length on the device, as far as read
        active = list(range(len(prompts)))
        in_flight: tuple[list[int], PendingRead] | None = None
        try:
            top.prefill(rows)
            while active or in_flight:
                launched = None
                if active:
                    emission = top.step(rows)
                    launched = (active, PendingRead(torch.cat([emission.tokens, emission.count[:, None]], 1)))
                if in_flight is not None:
                    done = self._take_step(*in_flight, completions, lengths, max_new_tokens, stop, finished)
                    if done:
                        active = [i for i in active if i not in done]
                        top.release(upload(torch.tensor(sorted(done)), device))
                        rows = upload(torch.tensor(active, dtype=torch.int64), device)
                    if active:
                        top.set_len_bound(max(lengths[i] for i in active) + top.step_growth)
                in_flight = launched
            return completions
        finally:
            top.release(upload(torch.arange(len(prompts)), device))

    @staticmethod
    def _take_step(
        stepped: list[int],
        read: PendingRead,
        completions: list[Completion],
        lengths: list[int],
        max_new_tokens: int,
        stop: StopCriteria,
        finished: Callable[[int], None],
    ) -> set[int]:
        """Apply one step's tokens (row j of the read belongs to prompt stepped[j]); returns the prompts
        that finished with it."""
        done = set()
        for i, values in zip(stepped, read.result()):
            generated = completions[i].token_ids
            if len(generated) >= max_new_tokens or completions[i].finish_reason == "stop":
                continue  # finished by an earlier step; this is its extra step
            count = values[-1]
            lengths[i] += count
            before = len(generated)
            generated += values[:count][: max_new_tokens - before]
            cut = stop.first_stop(generated, before)
            if cut is not None:
                del generated[cut:]
                completions[i].finish_reason = "stop"
            if cut is not None or len(generated) == max_new_tokens:
                finished(i)
                done.add(i)
        return done

    def _level_stats(self, total_seconds: float) -> list[dict[str, Any]]:
        out = []
        for lc, level in zip(self.stack.configs, self.stack.levels):
            stats = level.stats()
            share = stats.pop("forward_seconds") / total_seconds if total_seconds > 0 else 0.0
            out.append({"kind": lc.kind, "model": lc.model, "share_of_time": share, **stats})
        return out

    def _generation_config(self, overrides: dict[str, Any]) -> GenerationConfig:
        known = {f.name for f in dataclasses.fields(GenerationConfig)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ConfigError(f"generate(): unknown generation option(s) {unknown}; known: {sorted(known)}")
        gen = dataclasses.replace(self.config.generation, **overrides)
        validate(dataclasses.replace(self.config, generation=gen), "generate()")
        return gen
