"""`HierarchicalDecoder`: the Python entry point, built from a config.

It loads the level stack and submits prompts to the stack's request driver (`hsmc.engine.driver`), which decodes
them with continuous batching on its own thread; `stream()` passes each request's output on as it settles and
`generate()` collects the results. Other threads may submit to the same driver (`decoder.driver`) at the same time,
as `hsmc serve` does. With `engine.tensor_parallel: N` it starts N - 1 following processes that build the same
stack on their shard and run the same driver turns (`hsmc.engine.ranks`); this process is rank 0.
"""

from __future__ import annotations

import atexit
import dataclasses
import gc
import math
import queue
import signal
import sys
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from hsmc.config import GenerationConfig, HsmcConfig, level_label, load_config, validate
from hsmc.engine.driver import Defaults, RequestDriver
from hsmc.engine.ranks import POOL, Ranks, join
from hsmc.engine.scheduler import Admission
from hsmc.engine.tops import StepTop
from hsmc.errors import ConfigError, ModelLoadError
from hsmc.levels.draft_length import IDLE
from hsmc.levels.rejection import RejectionLevel
from hsmc.levels.stack import build_stack
from hsmc.models.loading import LoadedModel
from hsmc.models.parallel import SINGLE
from hsmc.preflight import check_stop_strings, prompt_token_ids
from hsmc.requests import Increment, Particle, Result, SamplingParams, SMCOutcome, derive_seed

__all__ = ["GenerationInterrupted", "HierarchicalDecoder", "Increment", "Particle", "Result", "SMCOutcome"]
WARMUP_STEPS = 12  # steps of each warmup batch: its steady shapes make 8 of the last 16 rounds, and are captured
WARMUP_PROMPTS = (8, 24, 64, 128, 256, 512, 1024)  # prompt lengths whose prefills the warmup runs once
TIMING_ROUNDS = 16  # a chosen draft shape (auto) times each arm over about this many rounds of a synthetic request
TIMING_DEEPEST_ROUNDS = 4  # ... in at most as many tokens as this many rounds of its deepest draft keeping them all ...
TIMING_REPEATS = 2  # ... this many times, keeping the fastest ...
TIMING_RETRIES = 4  # ... of timings without a graph capture (at most this many more tries)
CATCH_UP_TOKENS = 32  # a drafter's catch-up is timed from prompts this many tokens longer (`_catch_up_ms`)


class GenerationInterrupted(KeyboardInterrupt):
    """Ctrl-C during `generate`: `results` maps the index of each prompt that had finished to its
    Result, so a caller can keep that work; `total` is how many prompts were asked for."""

    def __init__(self, results: dict[int, Result], total: int) -> None:
        super().__init__(f"{len(results)} of {total} prompts finished")
        self.results, self.total = results, total


class HierarchicalDecoder:
    def __init__(
        self, config: HsmcConfig, models: dict[str, LoadedModel] | None = None, ranks: Ranks | None = None
    ) -> None:
        """`models` supplies already-built models by the `model` string a level names (e.g. random weights
        of a real shape for `hsmc bench`); every other level loads its model as usual. `ranks`: the
        tensor-parallel group of a following rank (rank 0 starts it from `engine.tensor_parallel`)."""
        self.config = config
        world = config.engine.tensor_parallel
        if models and world > 1:
            raise ConfigError(f"engine.tensor_parallel={world}: every rank builds its own shard, so models= is refused")
        if ranks is None and world > 1:
            ranks = POOL.lease(world, config.engine.device, _follow)
            if not ranks.leader:  # a torchrun rank: it follows rank 0's decoders, then its process ends
                follow_configs(ranks)
                ranks.leave()
                raise SystemExit(0)
            ranks.broadcast(config)
        self.ranks = ranks
        error = None
        try:
            self.stack = build_stack(config, models or {}, ranks.tp if ranks is not None else SINGLE)
        except ModelLoadError as e:
            error = type(e)(f"{self._levels_using(e.source)}: {e}", e.source)
        except Exception as e:  # every rank must hear of it before any raises
            error = e
        if ranks is not None:
            try:
                ranks.check(error)
            except Exception:
                if ranks.leader:
                    POOL.give_back(ranks)
                raise
        if error is not None:
            raise error from None
        self.tokenizer = self.stack.tokenizer
        self._driver: RequestDriver | None = None
        self._warm = False
        if ranks is not None and ranks.leader:  # closed before the pool ends the group (atexit runs last in first)
            atexit.register(_close_at_exit, weakref.ref(self))
        if config.engine.warmup and (ranks is None or ranks.leader):
            self.warmup()
        leads = ranks is None or ranks.leader  # a following rank takes rank 0's round times (`Stack.mode`)
        if leads and isinstance(self.stack.top, RejectionLevel) and self.stack.top.draft_length is not None:
            self._time_rounds(self.stack.top)

    def _time_rounds(self, level: RejectionLevel) -> None:
        """`num_draft_tokens: auto` / `tree: auto`: each arm's round time on this machine (a chain's γ, a tree), from a
        synthetic request decoded with it: the time between its first and last read of a round's tokens over the rounds
        between, the fastest of TIMING_REPEATS timings after one untimed run (the first calls of a process are slower).
        Only the steady rounds count: a difference of whole runs (with and without rounds) carried their admission's and
        prefill's noise (docs/measurements/2026-11-29-h200-steady-timing-and-evidence.txt). Every arm is timed over
        about TIMING_ROUNDS rounds, however many tokens its rounds keep (given the tokens of 4 rounds that keep all
        their drafts, γ = 0 got 3 rounds, too few for the host's noise:
        docs/measurements/2026-11-29-h200-auto-timing-rounds.txt). With CUDA graphs each shape is captured at its first
        run and a timing during which any graph was captured is taken again: a capture costs more than many rounds (on
        an H100 such timings came out negative). Timed at 1, 4, 16, ... requests and at as many as the rows (and the KV
        pools) hold: a round's time is flat while the weight read bounds it and grows with the rows once the arithmetic
        does, and the choice at a batch size between takes the times linearly between its neighbours. Then, per batch
        size, the drafters' catch-up on a round without drafts (`_catch_up_ms`), which a probe pays."""
        from tqdm import tqdm

        choice, scope = level.draft_length, self.stack.scope
        prompt = [t % self.vocab_size for t in range(1, 17)]
        most_tokens = TIMING_DEEPEST_ROUNDS * (max(choice.shape(arm)[0] for arm in range(choice.arms)) + 1)
        longest = len(prompt) + max(most_tokens, CATCH_UP_TOKENS + 1)
        fit = self.stack.capacity // (longest + self.stack.lookahead)  # requests the KV pools hold at once
        full = max(1, min(self.stack.max_rows // self.stack.rows_per_prompt, fit))
        sizes = sorted({1, full, *(4**k for k in range(1, full.bit_length()) if 2 * 4**k <= full)})
        bar = tqdm(total=(choice.arms + 1) * len(sizes), desc="draft shape: auto, timing rounds", unit="shape",
                   file=sys.stderr)  # fmt: skip
        was, scope.capturing = scope.capturing, "every"
        try:
            choice.forced = choice.most
            self.generate([prompt], max_new_tokens=most_tokens, ignore_eos=True)
            times: dict[int, list[float]] = {}
            for n, arm in ((n, arm) for n in sizes for arm in range(choice.arms)):
                choice.forced, runs, ms = arm, [], 0.0
                tokens = min(most_tokens, TIMING_ROUNDS + 1)  # a round keeps at least one token
                for _ in range(TIMING_REPEATS + TIMING_RETRIES):
                    graphs, reads = scope.graphs_captured(), []
                    note = _reads_of_first(reads)
                    self.generate([prompt] * n, max_new_tokens=tokens, ignore_eos=True, on_progress=note)
                    rounds = len(reads) - 1  # between the first read and the last (a request is read once a round)
                    if rounds > 0 and scope.graphs_captured() == graphs:
                        runs.append((reads[-1] - reads[0]) / rounds)
                    # as many tokens as TIMING_ROUNDS rounds keep at the rate seen
                    tokens = min(most_tokens, 1 + math.ceil(TIMING_ROUNDS * (tokens - 1) / max(len(reads), 1)))
                    ms = 1000 * min(runs) if runs else 0.0
                    if len(runs) >= TIMING_REPEATS:
                        break
                if ms <= 0:
                    raise RuntimeError(
                        f"draft shape auto: no clean timing of {choice.shape(arm)} (each captured a CUDA graph or its"
                        " request ended before a second round)"
                    )
                times.setdefault(n, []).append(ms)
                bar.update()
            choice.forced, catch_up = 0, {}
            for n in sizes:
                catch_up[n] = self._catch_up_ms(prompt, n)
                bar.update()
        finally:
            scope.capturing, choice.forced = was, None
            bar.close()
        choice.round_ms, choice.catch_up_ms = times, catch_up
        choice.forget()

    def _catch_up_ms(self, prompt: list[int], n: int) -> float:
        """The drafters' forward time per token each of `n` rows leaves them in a round of γ = 0, in ms: a drafter
        processes those tokens at its next draft, as it processes a prompt, so it is timed from prefills of
        prompts CATCH_UP_TOKENS longer (the levels below the top alone, each the fastest of TIMING_REPEATS + 1)."""
        below = self.stack.levels[:-1]
        seconds = []
        for tokens in (prompt, prompt + prompt[:1] * CATCH_UP_TOKENS):
            runs = []
            for _ in range(TIMING_REPEATS + 1):
                self.generate([tokens] * n, max_new_tokens=1, ignore_eos=True)
                runs.append(sum(level.stats()["forward_seconds"] for level in below))
            seconds.append(min(runs))
        return max(0.0, 1000 * (seconds[1] - seconds[0]) / CATCH_UP_TOKENS)

    @classmethod
    def from_config(cls, source: str | Path | DictConfig | dict, overrides: Sequence[str] = ()) -> HierarchicalDecoder:
        return cls(load_config(source, overrides))

    @property
    def driver(self) -> RequestDriver:
        """The stack's request loop (started by the first submission)."""
        if self._driver is None:
            stack, gen = self.stack, self.config.generation
            top = stack.top if stack.is_smc else StepTop(stack.top)
            defaults = Defaults(
                gen.max_new_tokens, stack.configs[-1].temperature, stack.rows_per_prompt, gen.ignore_eos,
                tuple(gen.stop), stack.is_smc, self.vocab_size,
            )  # fmt: skip
            admission = Admission(stack.max_rows, stack.capacity, stack.lookahead, stack.rows_per_prompt)
            eos, kinds = frozenset(stack.eos_token_ids), [c.kind for c in stack.configs]
            self._driver = RequestDriver(
                top, admission, defaults, eos, self.tokenizer, kinds, stack.assign, stack.clear, self.ranks,
                lambda: stack.mode,
            )  # fmt: skip
        return self._driver

    def follow(self) -> None:
        """A following tensor-parallel rank: run rank 0's driver turns until its decoder closes, then destroy the
        graphs, as rank 0's `close` does."""
        self.driver.follow(self.stack.set_mode)
        self.stack.scope.release()

    @property
    def vocab_size(self) -> int:
        """Token ids a prompt may hold: the top level's vocabulary (every level shares it)."""
        return self.stack.top.state.runner.module.config.vocab_size

    @property
    def is_smc(self) -> bool:
        return self.stack.is_smc

    def kv_slots_in_use(self) -> int:
        """KV slots held in the stack's pools (one read of the device): 0 once every request has ended."""
        return max(r.tables.allocator.num_slots - r.tables.allocator.num_free() for r in self.stack.runners)

    def warmup(self, progress: bool = True) -> None:
        """Capture the CUDA graphs of every batch the config can run before the first request, so that no request
        pays a capture (`engine.warmup`, and `hsmc serve`): for 1, 2, ... up to as many requests as the rows hold,
        a batch of that many short synthetic requests decodes until each of its steady shapes is captured (a
        forward's graphs cover every row and context bucket of its width at once; a rejection round's or SMC
        cycle's are captured once a shape makes 8 of the last 16). Under a block fill a cycle's graph also depends on
        the rounds R it plans from the acceptance law, which real traffic does not share with synthetic requests:
        one request and a full batch run again once for every R a plan may take (`BlockFill.choices`), each shape
        captured at its second run (every batch size at every R took over 10 minutes for the hierarchical stack's 16
        sizes x 13 R on an H100). Then capturing stops: a shape first seen later (a context past the first bucket,
        another mix of sampling laws, a batch size between at an R the warmup's law did not plan) runs eagerly and is
        counted (`Graphs.missed`). Under `num_draft_tokens: auto` / `tree: auto` a round's graph depends on the
        shape chosen from the acceptance seen so far: every batch size runs again once with each shape, and with
        rounds of γ = 0 that leave the drafters out (a choice gone idle), captured at its first run (a `model`
        drafter's probe after a long streak without drafts still runs eagerly: it catches up on a number of tokens
        no warmup can foresee; an EAGLE3 head's backlog takes one bound, `max_pending`).
        Prefills of a few sizes run once, so that their kernels are compiled too. Nothing to do without graphed
        units."""
        scope = self.stack.scope
        if self._warm or not scope.units:
            return
        self._warm = True
        import torch
        from tqdm import tqdm

        stack = self.stack
        top = stack.configs[-1]
        per_step = {"smc": top.block_size + 1, "rejection": top.path_length + 1}.get(top.kind, 1)
        vocab = self.vocab_size
        most = stack.max_rows // stack.rows_per_prompt
        batches: list[tuple[int, int, int, int | None]] = [
            (n, 16, WARMUP_STEPS * per_step, None) for n in range(1, most + 1)
        ]
        forced = stack.choice  # what a batch's last item fixes: a block fill's R, a draft shape
        if stack.is_smc and forced is not None:  # two blocks at each R: a second cycle of its shape
            batches += [(n, 16, 2 * per_step + 1, r) for n in sorted({1, most}) for r in forced.choices(top.block_size)]
        elif forced is not None:  # three rounds of each draft shape, and of γ = 0 with the drafters out (gone idle)
            arms = [(arm, forced.shape(arm)[0]) for arm in range(forced.arms)] + [(IDLE, 0)]
            batches += [(n, 16, 3 * (depth + 1), arm) for n in range(1, most + 1) for arm, depth in arms]
        # prefills of other sizes compile their kernels with one token each: Triton specializes on the shapes, and
        # the attention plans (splits by occupancy) change where the row count crosses a power of two
        counts = sorted({1, most, *(2**k + 1 for k in range(most.bit_length()) if 2**k + 1 <= most)})
        batches += [(n, length, 1, None) for length in WARMUP_PROMPTS for n in counts]
        fits = [batch for batch in batches if batch[1] + batch[2] < stack.capacity // batch[0]]
        for n, length, tokens, fixed in tqdm(fits, desc="warmup: CUDA graphs", unit="batch", file=sys.stderr,
                                             disable=not progress):  # fmt: skip
            if forced is not None:
                forced.forced = fixed
            scope.capturing = "recurring" if fixed is None else "every"
            prompts = [[(7919 * (n + i) + 13 * j) % vocab for j in range(length)] for i in range(n)]
            self.generate(prompts, params=SamplingParams(max_tokens=tokens, ignore_eos=True), seed=n)
            torch.cuda.empty_cache()  # what a batch's eager runs cached goes back before the next captures
        scope.capturing = "none"
        if forced is not None:
            forced.forced = None
        stack.reset_stats()
        gc.collect()
        gc.freeze()  # what exists now (models, graphs) stays out of later collections: no long pause mid-request

    def close(self, timeout: float = 0.0) -> None:
        """Stop the request loop: running requests get `timeout` seconds to finish, then are cancelled. Under
        tensor parallelism the following ranks stop too."""
        if self._driver is not None:
            self._driver.shutdown(timeout)
        if self.ranks is not None:
            self.ranks.broadcast(None)  # the followers' decoders stop; their processes wait for the next config
            self.stack.scope.release()  # graphs that captured NCCL collectives would keep the group from ending
            POOL.give_back(self.ranks)
            self.ranks = None

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        on_finish: Callable[[int], None] | None = None,
        on_progress: Callable[[Increment], None] | None = None,
        particles: int | Sequence[int] | None = None,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        **generation_overrides: Any,
    ) -> list[Result]:
        """Complete `prompts` (texts, chat-templated if configured, or token-id lists used as is).

        `on_finish(i)` runs when prompt i is done; `on_progress(increment)` at every read of a request (its
        `generated` tokens and live level statistics: a progress signal). `particles` (an smc top): N for every
        prompt or per prompt; requests with different N decode in one batch. `params`: per-request sampling
        parameters, for every prompt or one per prompt (unset fields come from the config and the overrides;
        without a seed prompt i decodes with the stream `derive_seed(generation.seed, i)`). Ctrl-C raises
        `GenerationInterrupted` carrying the prompts that had finished.
        """
        by_index: dict[int, Result] = {}
        start = time.perf_counter()
        try:
            for increment in self.stream(prompts, on_progress, particles, params, **generation_overrides):
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

    def stream(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        on_progress: Callable[[Increment], None] | None = None,
        particles: int | Sequence[int] | None = None,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        **generation_overrides: Any,
    ) -> Iterator[Increment]:
        """Complete `prompts` like `generate`, yielding each request's output as it settles: for a model or
        rejection top the tokens it commits, for an smc top the consensus prefix of its particles. Closing the
        iterator early cancels the requests still running."""
        gen = self._generation_config(generation_overrides)
        ids = prompt_token_ids(self.tokenizer, prompts, gen.chat_template)
        check_stop_strings(gen, self.tokenizer)
        requests = self._request_params(gen, len(ids), particles, params)
        driver = self.driver
        rows = [p.particles or self.stack.rows_per_prompt for p in requests]
        driver.admission.check([len(i) for i in ids], [p.max_tokens for p in requests], rows)
        if driver.quiesce():  # statistics of this call alone (another thread's requests would share them)
            self.stack.reset_stats()
        out: queue.SimpleQueue[Increment] = queue.SimpleQueue()
        request_ids = driver.submit(ids, requests, out.put, indices=range(len(ids)))
        remaining = len(ids)
        try:
            while remaining:
                increment = _next(out)
                if increment.error is not None:
                    raise increment.error
                if on_progress is not None:
                    on_progress(increment)
                if increment.result is not None:
                    remaining -= 1
                if increment.token_ids or increment.result is not None:
                    yield increment
        finally:
            if remaining:
                driver.cancel(request_ids)

    def _request_params(
        self,
        gen: GenerationConfig,
        prompts: int,
        particles: int | Sequence[int] | None,
        params: SamplingParams | Sequence[SamplingParams] | None,
    ) -> list[SamplingParams]:
        """One SamplingParams per prompt: `params` (or the defaults) completed from the generation config."""
        given = [params or SamplingParams()] * prompts if not isinstance(params, Sequence) else list(params)
        if len(given) != prompts:
            raise ConfigError(f"params: one SamplingParams, or one per prompt ({prompts}), got {len(given)}")
        counts = self._particles(particles, prompts)
        return [
            dataclasses.replace(
                p,
                max_tokens=p.max_tokens if p.max_tokens is not None else gen.max_new_tokens,
                stop=p.stop if p.stop is not None else tuple(gen.stop),
                seed=p.seed if p.seed is not None else derive_seed(gen.seed, i),
                particles=p.particles if counts[i] is None else counts[i],
                ignore_eos=p.ignore_eos or gen.ignore_eos,
            )
            for i, p in enumerate(given)
        ]

    def _particles(self, particles: int | Sequence[int] | None, prompts: int) -> list[int | None]:
        """N per prompt for an smc top (`particles`), or None: the level's."""
        if particles is None:
            return [None] * prompts
        if not self.stack.is_smc:
            raise ConfigError(f"particles={particles!r}: only an smc top level has particles")
        counts = [particles] * prompts if isinstance(particles, int) else list(particles)
        if len(counts) != prompts or not all(isinstance(n, int) and n >= 1 for n in counts):
            raise ConfigError(f"particles={particles!r}: one int >= 1, or one per prompt ({prompts})")
        return counts

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


def _close_at_exit(decoder: weakref.ref[HierarchicalDecoder]) -> None:
    if (alive := decoder()) is not None:
        alive.close()


def _follow(rank: int, world_size: int, init_method: str, device: str) -> None:
    """A spawned tensor-parallel rank (`hsmc.engine.ranks.start_ranks`), until rank 0's process ends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the terminal's whole group: rank 0 stops us
    ranks = join(rank, world_size, init_method, device)
    follow_configs(ranks)
    ranks.leave()


def follow_configs(ranks: Ranks) -> None:
    """A following rank: build the stack of each config rank 0 sends and follow its decoder's turns, until rank 0
    ends the group."""
    while (config := ranks.broadcast()) is not None:
        try:
            decoder = HierarchicalDecoder(config, ranks=ranks)
        except Exception:  # rank 0 raises it for every rank (`Ranks.check`) and goes on
            continue
        decoder.follow()
        del decoder
        gc.collect()  # the stack's cycles (runners, graphs) go before the next config's loads


def _reads_of_first(reads: list[float]) -> Callable[[Increment], None]:
    """An `on_progress` that notes when each round's tokens of the first request were read, up to its last: the
    span between two reads is rounds at the steady rate, without the admission, prefill and drain around them."""

    def note(increment: Increment) -> None:
        if increment.index == 0 and increment.result is None:
            reads.append(time.perf_counter())

    return note


def _next(out: queue.SimpleQueue[Increment]) -> Increment:
    """The next increment, waiting in short slices so that Ctrl-C reaches the caller at once."""
    while True:
        try:
            return out.get(timeout=0.1)
        except queue.Empty:
            continue
