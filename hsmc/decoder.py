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

from hsmc.config import GenerationConfig, HsmcConfig, level_label, load_config, validate
from hsmc.engine.host_io import PendingRead, upload
from hsmc.engine.scheduler import plan_waves
from hsmc.errors import ConfigError, ModelLoadError
from hsmc.levels.stack import build_stack
from hsmc.models.loading import LoadedModel
from hsmc.preflight import check_stop_strings, min_prompt_tokens, prompt_token_ids
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


class GenerationInterrupted(KeyboardInterrupt):
    """Ctrl-C during `generate`: `results` maps the index of each prompt that had finished to its
    Result, so a caller can keep that work; `total` is how many prompts were asked for."""

    def __init__(self, results: dict[int, Result], total: int) -> None:
        super().__init__(f"{len(results)} of {total} prompts finished")
        self.results, self.total = results, total


class HierarchicalDecoder:
    def __init__(self, config: HsmcConfig, models: dict[str, LoadedModel] | None = None) -> None:
        """`models` supplies already-built models by the `model` string a level names (e.g. random weights
        of a real shape for `hsmc bench`); every other level loads its model as usual."""
        self.config = config
        try:
            self.stack = build_stack(config, models or {})
        except ModelLoadError as e:
            raise type(e)(f"{self._levels_using(e.source)}: {e}", e.source) from None
        self.tokenizer = self.stack.tokenizer

    @classmethod
    def from_config(cls, source: str | Path | DictConfig | dict, overrides: Sequence[str] = ()) -> HierarchicalDecoder:
        return cls(load_config(source, overrides))

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        on_finish: Callable[[int], None] | None = None,
        on_progress: Callable[[int], None] | None = None,
        **generation_overrides: Any,
    ) -> list[Result]:
        """Complete `prompts` (texts, chat-templated if configured, or token-id lists used as is).

        `on_finish(i)` runs when prompt i is done; `on_progress(n)` whenever a row has n generated
        tokens (a progress signal for a single prompt). Ctrl-C raises `GenerationInterrupted`
        carrying the prompts that had finished.
        """
        gen = self._generation_config(generation_overrides)
        ids = prompt_token_ids(self.tokenizer, prompts, gen.chat_template, min_prompt_tokens(self.config))
        check_stop_strings(gen, self.tokenizer)
        eos = frozenset() if gen.ignore_eos else frozenset(self.stack.eos_token_ids)
        stop = StopCriteria(eos, tuple(gen.stop), self.tokenizer, on_check=on_progress)
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
        completions: dict[int, Completion] = {}
        try:
            for wave in waves:

                def finished(j: int, completion: Completion | None = None, wave: list[int] = wave) -> None:
                    """Prompt wave[j] is done; a streaming top hands its completion over at once, so
                    Ctrl-C keeps it (an smc top picks its particles when the whole wave is done)."""
                    finished_at[wave[j]] = time.perf_counter() - start
                    if completion is not None:
                        completions[wave[j]] = completion
                    if on_finish:
                        on_finish(wave[j])

                wave_ids = [ids[i] for i in wave]
                if self.stack.is_smc:
                    groups = self.stack.top.run(wave_ids, gen.max_new_tokens, stop, finished)
                    done = [Completion(g.token_ids, g.finish_reason) for g in groups]
                else:
                    done = self._stream_wave(wave_ids, gen.max_new_tokens, stop, finished)
                completions.update(zip(wave, done))
        except KeyboardInterrupt:
            raise GenerationInterrupted(self._results(completions, finished_at, stop, start), len(ids)) from None
        results = self._results(completions, finished_at, stop, start)
        return [results[i] for i in range(len(ids))]

    def _results(
        self, completions: dict[int, Completion], finished_at: dict[int, float], stop: StopCriteria, start: float
    ) -> dict[int, Result]:
        """Results of the finished prompts, by prompt index; level stats cover the time since `start`."""
        level_stats = self._level_stats(time.perf_counter() - start)
        results = {}
        for i, c in completions.items():
            seconds = finished_at[i]
            text = stop.trim(self.tokenizer.decode(c.token_ids, skip_special_tokens=True)) if self.tokenizer else ""
            stats = {
                "new_tokens": len(c.token_ids),
                "seconds": seconds,
                "tokens_per_s": len(c.token_ids) / seconds,
                "levels": level_stats,
            }
            results[i] = Result(text=text, token_ids=c.token_ids, finish_reason=c.finish_reason, stats=stats)
        return results

    def _stream_wave(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        stop: StopCriteria,
        finished: Callable[[int, Completion], None],
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
        finished: Callable[[int, Completion], None],
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
                finished(i, completions[i])
                done.add(i)
        return done

    def _levels_using(self, source: str | None) -> str:
        """`levels[1] (rejection), levels[2] (smc)`: the levels whose model is `source`. Errors without a
        source come from the EAGLE3 head loader."""
        levels = list(enumerate(self.config.levels))
        using = [(i, lc) for i, lc in levels if lc.model == source]
        using = using or [(i, lc) for i, lc in levels if lc.kind == "eagle3"] or levels
        return ", ".join(level_label(i, lc) for i, lc in using)

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
