"""CUDA graphs over a whole round of a level: several forwards and the work between them, replayed as one.

A rejection round (the drafter's γ proposals, the verify, the acceptance test, both models' rollback, an
EAGLE3 head catching up on the verifier's features) launches hundreds of small kernels from Python, and an
SMC cycle (resampling plan and fork, the K proposals or the block fill's rounds, the target verify, the
bonus, the ends and the weights) thousands. For an EAGLE3 drafter that launching was most of the round: one
head draft step took 1.41 ms of wall time for 0.31 ms of kernels on an H200. Captured once per shape, a round
is one replay. A round may contain rounds of levels below with graphs of their own (a block fill's rejection
rounds inside an SMC cycle): while the outer one is captured, those run eagerly (graphs do not nest); while
it runs eagerly (a shape not captured yet), they replay as they would alone.

A capture fixes, besides the device tensors it reads and writes in place:
- the shape of its inputs (the number of rows: exact, rows are real ids; whether a mask is passed);
- the host-side ints the round's code reads (`HostField`s: pending-token bounds, draft counts, planned
  rounds). Those that are keys are part of the graph's key;
- a context bucket that bounds every row's length during the round: attention is planned for it, and the
  torch backend gathers that many keys, so every forward inside sees it as its context (`fixed_context`).
  The length bounds start the capture at the bucket minus what the round adds to them, so every width the
  round's code takes from them (forks' copies, block-table reads) covers any replay the bucket allows.
Length bounds and counters advance by the same amount in every round of one shape: the first rounds of a
shape run eagerly and measure that amount (checked equal); once a shape makes 8 of the last 16 rounds it is
captured (after an eager run of its own that compiles every kernel with the bucket's plans); from then on
rounds of that shape replay and advance the host ints by it. The capture checks that its host ints move as
the eager runs' did.

Inside a round every forward runs eagerly (per-forward graphs do not nest in a capture, and the first round
of a shape must measure the same host effects) and the per-forward timers are paused: the level times the
round as a whole. Random numbers are counter-based (`random_streams`), keyed by device tensors the round reads,
so a replay draws what the same round run eagerly would.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from hsmc.engine.cuda_graphs import no_cyclic_gc
from hsmc.engine.runner import ModelRunner
from hsmc.engine.timer import ForwardTimer


@dataclass(frozen=True)
class HostField:
    """A host int that a round reads or changes: `owner.<name>` (an attribute, or a property it never moves)."""

    owner: Any
    name: str
    role: Literal["key", "length", "count"] = "key"  # key: a graph is valid for one value; length: a length bound,
    # advances by the round's measured amount and picks the context bucket; count: a statistic, advances by it


@dataclass
class GraphParts:
    """What a level's round touches besides device tensors: its runners, its timers and its host ints."""

    runners: list[ModelRunner] = field(default_factory=list)
    timers: list[ForwardTimer] = field(default_factory=list)
    host: list[HostField] = field(default_factory=list)
    graphs: list[RoundGraphs] = field(default_factory=list)  # of rounds inside this one: eager while it is captured

    def __add__(self, other: GraphParts) -> GraphParts:
        return GraphParts(
            self.runners + other.runners, self.timers + other.timers, self.host + other.host, self.graphs + other.graphs
        )


class _GraphMemory:
    """The memory pool and the stream captures run on, made at the first capture. Graphs of rounds that never
    run at once share one (a cycle's and its block fill's rounds): the pool is as large as the larger round
    needs, not the sum. Outputs of a graph are valid until the next replay of any graph of the pool."""

    def __init__(self) -> None:
        self.pool: Any = None
        self.stream: torch.cuda.Stream | None = None

    def get(self) -> tuple[Any, torch.cuda.Stream]:
        if self.stream is None:
            self.pool, self.stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
        return self.pool, self.stream


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor | None, ...]  # static input buffers
    outputs: Any  # static outputs, valid until the next replay of a graph of this pool (`_GraphMemory`)


class RoundGraphs:
    capture_after = 8  # a shape is captured once it makes 8 of the last 16 rounds. A capture (an eager run, the
    # capture, the graph's instantiation) costs ~70-90 ms at 16 rows of the 8B, ~10 rounds. A steady batch repeats
    # its shapes (under smc a block fill cycles through a few), while rows finishing one by one at the end of a
    # batch make shapes of 1-6 rounds each (H200), not worth capturing
    window = 16

    def __init__(
        self,
        round_fn: Callable[..., Any],
        parts: GraphParts,
        context_buckets: list[int],
    ) -> None:
        """`round_fn(*inputs)`: the round (tensors or None in, tensors out), all of its effects on the device
        in place or in `parts.host`."""
        self.round_fn = round_fn
        self.runners = list({id(r): r for r in parts.runners}.values())
        self.timers = list({id(t): t for t in parts.timers}.values())
        self.host = parts.host
        self.inner = parts.graphs
        self.inside_outer = False  # an outer round is being captured: run eagerly, untouched
        self.context_buckets = context_buckets
        self.deltas: dict[tuple, tuple[int, ...]] = {}  # per shape: how the round moves the host ints
        self.recent: deque[tuple] = deque(maxlen=self.window)  # the shapes of the last rounds
        self.memory = _GraphMemory()
        for graphs in self.inner:
            graphs.memory = self.memory
        self.captured: dict[tuple, _Captured] = {}
        self.replays = 0
        self.frozen = False  # after a warmup: a shape not captured runs eagerly instead of capturing mid-request

    def __call__(self, *inputs: torch.Tensor | None) -> Any:
        """The round over `inputs`, replayed, captured, or run eagerly."""
        if self.inside_outer:
            return self.round_fn(*inputs)
        before = self.snapshot()
        shape = (tuple(None if x is None else (tuple(x.shape), x.dtype) for x in inputs), self.key(before))
        self.recent.append(shape)
        delta = self.deltas.get(shape)
        context = None
        if delta is not None:
            after = tuple(b + d for b, d in zip(before, delta))
            longest = max((a for f, a in zip(self.host, after) if f.role == "length"), default=1)
            context = next((c for c in self.context_buckets if c >= longest), None)  # None: longer than any
        captured = self.captured.get((shape, context))
        if captured is None and (self.frozen or self.recent.count(shape) < self.capture_after):
            context = None
        if context is None:  # eager, measuring how the round moves the host ints
            with self._inside(None):
                outputs = self.round_fn(*inputs)
            moved = tuple(a - b for a, b in zip(self.snapshot(), before))
            if self.deltas.setdefault(shape, moved) != moved:
                raise RuntimeError(f"two rounds of one shape moved their host ints by {moved} and {delta}")
            return outputs
        if captured is None:
            return self._capture((shape, context), inputs, before, after, context)
        for static, value in zip(captured.inputs, inputs):
            if value is not None:
                static.copy_(value)
        captured.graph.replay()
        self.restore(after)
        self.replays += 1
        return captured.outputs

    def snapshot(self) -> tuple[int, ...]:
        return tuple(getattr(f.owner, f.name) for f in self.host)

    def restore(self, values: tuple[int, ...]) -> None:
        for f, value in zip(self.host, values):
            if getattr(f.owner, f.name) != value:
                setattr(f.owner, f.name, value)

    def key(self, values: tuple[int, ...]) -> tuple[int, ...]:
        """The host ints a capture is only valid for."""
        return tuple(v for f, v in zip(self.host, values) if f.role == "key")

    def _capture(
        self,
        key: tuple,
        inputs: tuple[torch.Tensor | None, ...],
        before: tuple[int, ...],
        after: tuple[int, ...],
        context: int,
    ) -> Any:
        """Run this round eagerly with the bucket's context (compiling what the capture records), then capture
        the same round from the same host ints, the length bounds raised to end at the bucket; returns the eager
        run's outputs."""
        pool, stream = self.memory.get()
        static = tuple(None if x is None else x.clone() for x in inputs)
        start = tuple(context - (a - b) if f.role == "length" else b for f, b, a in zip(self.host, before, after))
        end = tuple(s + a - b for s, b, a in zip(start, before, after))
        with self._inside(context):
            outputs = self.round_fn(*static)
            if self.snapshot() != after:
                raise RuntimeError(f"a round moved its host ints to {self.snapshot()}, an earlier one to {after}")
            self.restore(start)
            torch.cuda.empty_cache()  # the eager run's cached blocks go back: the capture allocates in its own pool
            graph = torch.cuda.CUDAGraph()
            stream.wait_stream(torch.cuda.current_stream())
            with no_cyclic_gc(), torch.cuda.stream(stream):  # (not torch.cuda.graph: it empties the caches)
                graph.capture_begin(pool=pool)
                try:
                    static_outputs = self.round_fn(*static)
                except BaseException:
                    with suppress(Exception):  # an invalidated capture: report what broke it, not that
                        graph.capture_end()
                    raise
                graph.capture_end()
            torch.cuda.current_stream().wait_stream(stream)
        if self.snapshot() != end:
            raise RuntimeError(f"a captured round moved its host ints to {self.snapshot()}, not {end}")
        self.restore(after)
        self.captured[key] = _Captured(graph, static, static_outputs)
        return outputs

    @contextmanager
    def _inside(self, context: int | None) -> Iterator[None]:
        """Per-forward timers paused; with a context bucket (a capture and the eager run before it), every forward
        eager and planned for it, and the rounds inside eager too."""
        with ExitStack() as stack:
            for timer in self.timers:
                stack.enter_context(timer.paused())
            if context is not None:
                for runner in self.runners:
                    runner.fixed_context = context
                for graphs in self.inner:
                    graphs.inside_outer = True
            try:
                yield
            finally:
                if context is not None:
                    for runner in self.runners:
                        runner.fixed_context = None
                    for graphs in self.inner:
                        graphs.inside_outer = False
