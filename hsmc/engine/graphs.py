"""CUDA graphs for the engine's units of work: a model forward, a rejection round, an SMC cycle.

Launching a unit's kernels from Python can cost more than the kernels (an EAGLE3 head's draft step: 1.41 ms of
wall time for 0.31 ms of kernels, H200; an SMC cycle launches thousands); a unit captured once per shape replays
as one launch. One mechanism serves the three kinds:
- the outermost unit that replays is the one captured. Units inside it (a round's forwards, the block fill's
  rounds inside a cycle) run as plain code while it is captured and replay as usual while it runs eagerly. The
  stack's units share one `GraphScope` that says which capture is in progress; nothing else is coordinated.
- A graph fixes the shapes of its inputs (static buffers a replay copies into), the host ints its code reads
  (`HostField`s: keys choose the graph; lengths and counts advance by what eager runs of the shape measured,
  checked at the capture) and a context bucket bounding every row's length, which every forward inside is
  planned for. Length bounds start a capture at the bucket minus the unit's growth, so every width its code
  takes from them (forks' copies, block-table reads) covers any replay the bucket allows.
- A forward's rows are padded to a bucket (padding rows point at the block tables' scratch row, bring no
  tokens and write to the trash slot); padding alone is a valid input, so a forward's first use captures every
  rows × context bucket of its width at once, largest first. A round's or cycle's rows are exact and its state
  is real: a shape is captured once it makes 8 of the last 16 runs of its unit (a steady batch repeats its
  shapes; rows finishing one by one make shapes of 1-6 rounds each, not worth a capture of ~10 rounds' time),
  after an eager run with the bucket's plans that compiles every kernel and is the call's result.
- All graphs share one memory pool: units never run at once, and every graph's outputs stay referenced, so no
  capture takes their blocks. Outputs are valid until the unit replays again.
Random numbers are counter-based (`random_streams`), keyed by device tensors the unit reads, so a replay draws
what an eager run would.
"""

from __future__ import annotations

import gc
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

CAPTURE_AFTER = 8  # a round's or cycle's shape is captured once it makes 8 of the last WINDOW runs of its unit. A
# capture (an eager run, the capture, the graph's instantiation) costs ~70-90 ms at 16 rows of the 8B, ~10 rounds;
# capturing at a shape's 2nd, 3rd or 8th run overall made 16 streams 0.67-0.71x slower (tail shapes captured)
WINDOW = 16
FORWARD_CAPTURE_AFTER = 2  # a forward's shape (tokens per row) is captured, in every rows x context bucket at once, at
# its second run of the last WINDOW: a drafter catching up after rounds without drafts runs a width seen once, and
# capturing its 5 buckets cost 78 ms on an H200 against ~1 ms for a SmolLM2 round (docs/engine.md, "CUDA graphs")


def geometric_buckets(first: int, factor: int, last: int) -> list[int]:
    """first, first·factor, ... below `last`, then `last` itself."""
    buckets, b = [], first
    while b < last:
        buckets.append(b)
        b *= factor
    return [*buckets, last]


@contextmanager
def _no_cyclic_gc() -> Iterator[None]:
    """Python's cycle collector off while a graph is captured: it may run at any allocation, and a dead decoder it
    frees destroys CUDA graphs, which invalidates the capture ("operation not permitted when stream is capturing";
    seen on an H200 after several decoders in one process)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclass(frozen=True)
class HostField:
    """A host int that a unit reads or changes: `owner.<name>` (an attribute, or a property it never moves)."""

    owner: Any
    name: str
    role: Literal["key", "length", "count"] = "key"  # key: a graph is valid for one value; length: a length bound,
    # advances by the unit's measured amount and picks the context bucket; count: a statistic, advances by it


@dataclass
class GraphParts:
    """What a level's round touches besides device tensors: the models it runs and its host ints."""

    modules: list[nn.Module] = field(default_factory=list)
    host: list[HostField] = field(default_factory=list)

    def __add__(self, other: GraphParts) -> GraphParts:
        return GraphParts(self.modules + other.modules, self.host + other.host)


Capturing = Literal["recurring", "every", "none"]  # shapes that make CAPTURE_AFTER of the last runs (a forward's
# at its first run); every shape at its first run whose host effects are known (a warmup); none (after a warmup:
# a shape without a graph runs eagerly, never a capture's stall mid-request)


class GraphScope:
    """What a stack's graphed units share, handed to each explicitly: the context bucket of a capture in progress
    (its forwards are planned for it, the units inside run as plain code), whether a unit is being timed whole
    (forwards inside are not timed on their own), which shapes are captured, and the memory pool."""

    def __init__(self, context_buckets: list[int]) -> None:
        self.context_buckets = context_buckets
        self.bucket: int | None = None
        self.timed_whole = False
        self.capturing: Capturing = "recurring"
        self.units: list[Graphs] = []
        self.pool: Any = None  # made at the first capture, with the side stream captures run on
        self._stream: torch.cuda.Stream | None = None

    def context_for(self, longest: int) -> int | None:
        """The smallest bucket holding `longest` tokens (None: longer than any)."""
        return next((c for c in self.context_buckets if c >= longest), None)

    @contextmanager
    def planned(self, bucket: int | None) -> Iterator[None]:
        """Forwards inside are planned for `bucket` and units inside run as plain code (a capture, its eager run)."""
        was, self.bucket = self.bucket, bucket
        try:
            yield
        finally:
            self.bucket = was

    def graphs_captured(self) -> int:
        """Graphs its units hold: a change between two reads means a capture ran in between."""
        return sum(len(unit.captured) for unit in self.units)

    def release(self) -> None:
        """Destroy every captured graph and its memory; later runs capture again. A stack under tensor parallelism
        must do this before its group ends: NCCL (2.26 on) destroys no communicator while a graph that captured its
        collectives lives, and the ranks' `destroy_process_group` waited forever (2 x H100, at process exit)."""
        if not any(unit.captured for unit in self.units):
            return
        torch.cuda.synchronize()  # no replay still running when its graph goes
        for unit in self.units:
            for captured in unit.captured.values():
                captured.graph.reset()
            unit.captured.clear()
        torch.cuda.empty_cache()  # the graphs' pool goes back to the caching allocator

    def record(self, run: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
        """run() captured into a graph of the shared pool (not `torch.cuda.graph`: it collects garbage and syncs)."""
        if self._stream is None:
            self.pool, self._stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
        torch.cuda.empty_cache()  # blocks an eager run cached go back: the capture allocates in its own pool
        graph = torch.cuda.CUDAGraph()
        self._stream.wait_stream(torch.cuda.current_stream())
        with _no_cyclic_gc(), torch.cuda.stream(self._stream):
            graph.capture_begin(pool=self.pool)
            try:
                outputs = run()
            except BaseException:
                with suppress(Exception):  # an invalidated capture: report what broke it, not that
                    graph.capture_end()
                raise
            graph.capture_end()
        torch.cuda.current_stream().wait_stream(self._stream)
        return graph, outputs


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor | None, ...]  # static input buffers
    outputs: Any  # static outputs


class Graphs:
    def __init__(
        self,
        run: Callable[..., Any],
        scope: GraphScope,
        host: list[HostField] | None = None,
        timer: Callable[[], AbstractContextManager[None]] | None = None,
        row_buckets: list[int] | None = None,
        pads: tuple[int | None, ...] = (),
    ) -> None:
        """`run(*inputs, **options)`: the unit (tensors or None in, tensors out), all of its effects on the device
        in place or in `host`. `timer`: times a call whole (the level's `ForwardTimer.whole`). With `row_buckets`
        (a forward, no host ints) the inputs' rows are padded to a bucket, input i's padding rows set to pads[i]
        (None, and inputs past `pads`: left as they are, ignored by the unit)."""
        self.run = run
        self.scope = scope
        self.host = host or []
        self.timer = timer
        self.row_buckets = row_buckets
        self.pads = pads
        self.capture_after = FORWARD_CAPTURE_AFTER if row_buckets else CAPTURE_AFTER
        self.deltas: dict[tuple, tuple[int, ...]] = {}  # per shape: how the unit moves the host ints
        self.recent: deque[tuple] = deque(maxlen=WINDOW)  # the shapes of the last runs
        self.captured: dict[tuple, _Captured] = {}
        self.replays = 0
        self.missed = 0  # runs of a shape without a graph while capturing is off: each ran eagerly
        scope.units.append(self)

    def __call__(self, *inputs: torch.Tensor | None, longest: int = 0, **options: Any) -> Any:
        """The unit over `inputs`, replayed, captured or run eagerly; `longest`: the most tokens a row holds after
        it, if the host ints do not say (a forward's context); `options`: host values it is keyed by, passed on."""
        if self.scope.bucket is not None:  # inside a capture: plain code
            return self.run(*inputs, **options)
        with self.timer() if self.timer is not None else nullcontext():
            return self._call(inputs, longest, options)

    def _call(self, inputs: tuple[torch.Tensor | None, ...], longest: int, options: dict[str, Any]) -> Any:
        rows = len(inputs[0]) if inputs[0] is not None else 0
        bucket = rows if self.row_buckets is None else next((b for b in self.row_buckets if b >= rows), None)
        before = self.snapshot()
        shape = self._shape(inputs, bucket, options, before)
        self.recent.append(shape)
        delta = self.deltas.get(shape, () if not self.host else None)
        context = after = None
        if delta is not None and bucket is not None:
            after = tuple(b + d for b, d in zip(before, delta))
            lengths = [a for f, a in zip(self.host, after) if f.role == "length"]
            context = self.scope.context_for(max([longest, *lengths]))
        captured = self.captured.get((shape, context))
        if captured is None and context is not None and self._due(shape):
            if self.row_buckets is None:
                static = tuple(None if x is None else x.clone() for x in inputs)
                return self._capture((shape, context), static, before, after, context, options)
            self._capture_buckets(inputs, options)
            captured = self.captured[(shape, context)]
        if captured is None:  # eager, measuring how the unit moves the host ints
            self.missed += self.scope.capturing == "none"
            with self.scope.planned(context if self.row_buckets else None):  # a forward is planned for its bucket
                outputs = self.run(*inputs, **options)
            moved = tuple(a - b for a, b in zip(self.snapshot(), before))
            if self.deltas.setdefault(shape, moved) != moved:
                raise RuntimeError(f"two runs of one shape moved their host ints by {moved} and {delta}")
            return outputs
        for static, value, pad in zip(captured.inputs, inputs, self._pads(len(inputs))):
            if value is not None:
                static[: len(value)].copy_(value)
                if pad is not None and len(value) < len(static):
                    static[len(value) :].fill_(pad)
        captured.graph.replay()
        self.restore(after)
        self.replays += 1
        if self.row_buckets is None:
            return captured.outputs
        return tuple(o[:rows] if isinstance(o, torch.Tensor) else o for o in captured.outputs)

    def _due(self, shape: tuple) -> bool:
        capturing = self.scope.capturing
        return capturing == "every" or (capturing == "recurring" and self.recent.count(shape) >= self.capture_after)

    def _shape(
        self, inputs: tuple[torch.Tensor | None, ...], rows: int | None, options: dict[str, Any], host: tuple[int, ...]
    ) -> tuple:
        """What a graph is only valid for: its inputs' shapes (a forward's rows padded to `rows`), the options, the
        host keys."""
        padded = self.row_buckets is not None
        shapes = tuple(
            None if x is None else ((rows, *x.shape[1:]) if padded else tuple(x.shape), x.dtype) for x in inputs
        )
        keys = tuple(v for f, v in zip(self.host, host) if f.role == "key")
        return shapes, tuple(sorted(options.items())), keys

    def _pads(self, n: int) -> tuple[int | None, ...]:
        return (*self.pads, *[None] * (n - len(self.pads)))[:n]

    def snapshot(self) -> tuple[int, ...]:
        return tuple(getattr(f.owner, f.name) for f in self.host)

    def restore(self, values: tuple[int, ...]) -> None:
        for f, value in zip(self.host, values):
            if getattr(f.owner, f.name) != value:
                setattr(f.owner, f.name, value)

    def _capture_buckets(self, inputs: tuple[torch.Tensor | None, ...], options: dict[str, Any]) -> None:
        """Every rows × context bucket of a forward's shape, largest first (smaller graphs reuse its blocks), each
        from padding alone."""
        for rows in sorted(self.row_buckets or [], reverse=True):
            static = tuple(
                None if x is None else torch.full((rows, *x.shape[1:]), pad or 0, dtype=x.dtype, device=x.device)
                for x, pad in zip(inputs, self._pads(len(inputs)))
            )
            for context in sorted(self.scope.context_buckets, reverse=True):
                key = (self._shape(static, rows, options, ()), context)
                if key not in self.captured:
                    self._capture(key, static, (), (), context, options)

    def _capture(
        self,
        key: tuple,
        static: tuple[torch.Tensor | None, ...],
        before: tuple[int, ...],
        after: tuple[int, ...],
        context: int,
        options: dict[str, Any],
    ) -> Any:
        """Run the unit eagerly on the static inputs with the bucket's plans (compiling what the capture records),
        then capture it from the same host ints, the length bounds raised to end at the bucket; returns the eager
        run's outputs."""
        start = tuple(context - (a - b) if f.role == "length" else b for f, b, a in zip(self.host, before, after))
        end = tuple(s + a - b for s, b, a in zip(start, before, after))
        with self.scope.planned(context):
            outputs = self.run(*static, **options)
            if self.snapshot() != after:
                raise RuntimeError(f"a run moved its host ints to {self.snapshot()}, an earlier one to {after}")
            self.restore(start)
            graph, static_outputs = self.scope.record(lambda: self.run(*static, **options))
        if self.snapshot() != end:
            raise RuntimeError(f"a captured run moved its host ints to {self.snapshot()}, not {end}")
        self.restore(after)
        self.captured[key] = _Captured(graph, static, static_outputs)
        return outputs
