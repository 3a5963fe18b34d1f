"""`HierarchicalDecoder`: the Python entry point, built from a config.

It loads the level stack and drives the top level with continuous batching: prompts join free rows
between steps as the KV pools allow (`Admission`), finished ones leave. An `smc` top decodes groups of
N particles per prompt; any other top steps all active rows at once.
Both drivers hand out each request's output as it settles; `stream()` passes it on as increments
and `generate()` collects the results.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from hsmc.config import GenerationConfig, HsmcConfig, level_label, load_config, validate
from hsmc.engine.host_io import PendingRead, upload
from hsmc.engine.scheduler import Admission
from hsmc.errors import ConfigError, ModelLoadError
from hsmc.levels.smc import GroupResult
from hsmc.levels.stack import build_stack
from hsmc.models.loading import LoadedModel
from hsmc.preflight import check_stop_strings, prompt_token_ids
from hsmc.stopping import StopCriteria
from hsmc.streaming import RequestEvent, TextStream


@dataclass
class Particle:
    token_ids: list[int]  # generated ids only
    text: str
    log_weight: float  # since the last resampling
    finish_reason: str


@dataclass
class SMCOutcome:
    """An smc top's whole particle system at the end of a request."""

    particles: list[Particle]  # all N, the returned one at index `chosen`
    chosen: int
    log_z: float  # log Ẑ: Σ over resampling intervals (the last included) of logsumexp(logw) − log N
    resamplings: int


@dataclass
class Result:
    text: str
    token_ids: list[int]  # generated ids only
    finish_reason: str  # "stop" or "length"
    stats: dict[str, Any]  # new_tokens, seconds (from the start to its last token), tokens_per_s; levels (generate)
    smc: SMCOutcome | None = None  # set when the top level is smc


@dataclass
class Increment:
    """Part of one request's output that can no longer change (a `stream()` item)."""

    index: int  # the prompt's index
    token_ids: list[int]  # tokens since the request's previous increment
    text: str  # text since the previous increment; all of them joined are a prefix of the final text
    result: Result | None = None  # set on the request's last increment


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

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        on_finish: Callable[[int], None] | None = None,
        on_progress: Callable[[int], None] | None = None,
        particles: int | Sequence[int] | None = None,
        **generation_overrides: Any,
    ) -> list[Result]:
        """Complete `prompts` (texts, chat-templated if configured, or token-id lists used as is).

        `on_finish(i)` runs when prompt i is done; `on_progress(n)` whenever a row has n generated
        tokens (a progress signal for a single prompt). `particles` (an smc top): N for every prompt or
        per prompt, instead of the level's; requests with different N decode in one batch. Ctrl-C raises
        `GenerationInterrupted` carrying the prompts that had finished.
        """
        by_index: dict[int, Result] = {}
        start = time.perf_counter()
        try:
            for increment in self.stream(prompts, on_progress, particles, **generation_overrides):
                if increment.result is not None:
                    by_index[increment.index] = increment.result
                    if on_finish:
                        on_finish(increment.index)
        except KeyboardInterrupt:
            raise GenerationInterrupted(self._with_level_stats(by_index, start), len(prompts)) from None
        results = self._with_level_stats(by_index, start)
        return [results[i] for i in range(len(results))]

    def _with_level_stats(self, results: dict[int, Result], start: float) -> dict[int, Result]:
        """`results` with the per-level statistics since `start` in every result's stats["levels"]."""
        level_stats = self.level_stats(time.perf_counter() - start)
        for r in results.values():
            r.stats["levels"] = level_stats
        return results

    @torch.inference_mode()
    def stream(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        on_progress: Callable[[int], None] | None = None,
        particles: int | Sequence[int] | None = None,
        **generation_overrides: Any,
    ) -> Iterator[Increment]:
        """Complete `prompts` like `generate`, yielding each request's output as it settles: for a model or
        rejection top the tokens it commits, for an smc top the consensus prefix of its particles."""
        gen = self._generation_config(generation_overrides)
        ids = prompt_token_ids(self.tokenizer, prompts, gen.chat_template)
        counts = self._particles(particles, len(ids))
        check_stop_strings(gen, self.tokenizer)
        eos = frozenset() if gen.ignore_eos else frozenset(self.stack.eos_token_ids)
        stop = StopCriteria(eos, tuple(gen.stop), self.tokenizer, on_check=on_progress)
        self.stack.generator.manual_seed(gen.seed)
        for level in self.stack.levels:
            level.reset_stats()
        engine = self.config.engine
        admission = Admission(
            [len(i) for i in ids],
            gen.max_new_tokens,
            engine.max_batch_rows,
            self.stack.capacity,
            counts,
            self.stack.lookahead,
        )
        start = time.perf_counter()
        if self.stack.is_smc:
            events = self.stack.top.run(ids, admission, gen.max_new_tokens, stop, counts)
        else:
            events = self._stream_rows(ids, admission, gen.max_new_tokens, stop)
        tokens: list[list[int]] = [[] for _ in ids]
        texts = [TextStream(self.tokenizer, stop) for _ in ids]
        for event in events:
            j = event.index
            tokens[j] += event.tokens
            if event.finish_reason is None:
                yield Increment(j, event.tokens, texts[j].update(tokens[j]))
                continue
            text = texts[j].finish(tokens[j])
            seconds = time.perf_counter() - start
            stats = {"new_tokens": len(tokens[j]), "seconds": seconds, "tokens_per_s": len(tokens[j]) / seconds}
            result = Result(texts[j].emitted, tokens[j], event.finish_reason, stats)
            if event.smc is not None:
                result.smc = self._smc_outcome(event.smc, texts[j])
            yield Increment(j, event.tokens, text, result)

    def _particles(self, particles: int | Sequence[int] | None, prompts: int) -> list[int]:
        """Rows per prompt: N per prompt for an smc top (`particles`, or the level's), else 1."""
        if particles is None:
            return [self.stack.rows_per_prompt] * prompts
        if not self.stack.is_smc:
            raise ConfigError(f"particles={particles!r}: only an smc top level has particles")
        counts = [particles] * prompts if isinstance(particles, int) else list(particles)
        if len(counts) != prompts or not all(isinstance(n, int) and n >= 1 for n in counts):
            raise ConfigError(f"particles={particles!r}: one int >= 1, or one per prompt ({prompts})")
        return counts

    @staticmethod
    def _smc_outcome(group: GroupResult, text: TextStream) -> SMCOutcome:
        particles = [
            Particle(tokens, text.final_text(tokens), weight, reason)
            for tokens, weight, reason in zip(group.particles, group.log_weights, group.finish_reasons)
        ]
        return SMCOutcome(particles, group.chosen, group.log_z, group.resamplings)

    def _stream_rows(
        self, prompts: list[list[int]], admission: Admission, max_new_tokens: int, stop: StopCriteria
    ) -> Iterator[RequestEvent]:
        """Decode rows from a non-SMC top level: each step runs one round for every active row and hands over
        all the tokens it produced; between steps, waiting prompts are prefilled into free rows (continuous
        batching). The host reads a step's tokens (one copy) while the next step already runs, so stop checks
        overlap with the GPU; a finished row is released one step later and its extra step's tokens dropped."""
        top = self.stack.top
        device = top.state.seq.device
        generated: dict[int, list[int]] = {}
        lengths: dict[int, int] = {}  # each active prompt's sequence length on the device, as far as read
        row_of: dict[int, int] = {}  # active prompt -> its row
        in_flight: tuple[list[int], PendingRead] | None = None
        try:
            while admission.busy or in_flight:
                if admitted := admission.admit():
                    if not row_of:  # no row holds anything: bounds left by earlier rows must not widen forwards
                        top.set_len_bound(0)
                    new_rows = upload(torch.tensor([row for _, row in admitted]), device)
                    top.load_prompts(new_rows, [prompts[i] for i, _ in admitted])  # the bound covers them now
                    for i, row in admitted:
                        row_of[i], generated[i], lengths[i] = row, [], len(prompts[i])
                    top.prefill(new_rows)
                launched = None
                if row_of:
                    stepped = list(row_of)
                    emission = top.step(upload(torch.tensor([row_of[i] for i in stepped]), device))
                    launched = (stepped, PendingRead(torch.cat([emission.tokens, emission.count[:, None]], 1)))
                if in_flight is not None:
                    events = self._take_step(*in_flight, generated, lengths, max_new_tokens, stop)
                    done = [e.index for e in events if e.finish_reason is not None]
                    if done:
                        top.release(upload(torch.tensor([row_of.pop(i) for i in done]), device))
                        for i in done:
                            admission.finish(i)
                    if row_of:
                        top.set_len_bound(max(lengths[i] for i in row_of) + top.step_growth)
                    yield from events
                in_flight = launched
        finally:
            if row_of:
                top.release(upload(torch.tensor(list(row_of.values())), device))

    @staticmethod
    def _take_step(
        stepped: list[int],
        read: PendingRead,
        generated: dict[int, list[int]],
        lengths: dict[int, int],
        max_new_tokens: int,
        stop: StopCriteria,
    ) -> list[RequestEvent]:
        """Apply one step's tokens (row j of the read belongs to prompt stepped[j]; a prompt no longer in
        `lengths` finished at an earlier step and this was its extra step)."""
        events = []
        for i, values in zip(stepped, read.result()):
            if i not in lengths:
                continue
            count = values[-1]
            lengths[i] += count
            before = len(generated[i])
            reason = stop.append(generated[i], values[:count], max_new_tokens)
            if reason is not None:
                del lengths[i]
            events.append(RequestEvent(i, generated[i][before:], reason))
        return events

    def _levels_using(self, source: str | None) -> str:
        """`levels[1] (rejection), levels[2] (smc)`: the levels whose model is `source`. Errors without a
        source come from the EAGLE3 head loader."""
        levels = list(enumerate(self.config.levels))
        using = [(i, lc) for i, lc in levels if lc.model == source]
        using = using or [(i, lc) for i, lc in levels if lc.kind == "eagle3"] or levels
        return ", ".join(level_label(i, lc) for i, lc in using)

    def level_stats(self, total_seconds: float) -> list[dict[str, Any]]:
        """Per-level statistics of the last run (`generate` puts them in every result's stats["levels"]);
        `share_of_time` is the level's forward time over `total_seconds`, `forward_ms` the mean of one of
        its `forwards` (prefills included)."""
        out = []
        for lc, level in zip(self.stack.configs, self.stack.levels):
            stats = level.stats()
            seconds = stats.pop("forward_seconds")
            share = seconds / total_seconds if total_seconds > 0 else 0.0
            forward_ms = 1000 * seconds / max(stats["forwards"], 1)
            out.append({"kind": lc.kind, "model": lc.model, "share_of_time": share, "forward_ms": forward_ms, **stats})
        return out

    def _generation_config(self, overrides: dict[str, Any]) -> GenerationConfig:
        known = {f.name for f in dataclasses.fields(GenerationConfig)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ConfigError(f"generate(): unknown generation option(s) {unknown}; known: {sorted(known)}")
        gen = dataclasses.replace(self.config.generation, **overrides)
        validate(dataclasses.replace(self.config, generation=gen), "generate()")
        return gen
