"""Time a level spends in its forwards, without a host read per forward.

On CUDA each timed region records a pair of events; they are read (one sync) only when the seconds
are asked for, at the end of a run. On the CPU the host clock is exact.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from hsmc.engine.graphs import GraphScope


class ForwardTimer:
    def __init__(self, device: torch.device, scope: GraphScope) -> None:
        """`scope`: the stack's graph scope, which says when a graphed unit is timed whole."""
        self.cuda = device.type == "cuda"
        self.scope = scope
        self.reset()

    def reset(self) -> None:
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._seconds = 0.0
        self.count = 0  # forwards timed

    @contextmanager
    def __call__(self) -> Iterator[None]:
        if self.scope.timed_whole:
            yield
            return
        self.count += 1
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self._events.append((start, end))
        else:
            began = time.perf_counter()
            yield
            self._seconds += time.perf_counter() - began

    @contextmanager
    def whole(self) -> Iterator[None]:
        """Time a graphed unit (a round, a cycle) as one forward, however it runs: the forwards inside it, of any
        level, are not timed on their own (a replay would not run them)."""
        with self():
            was, self.scope.timed_whole = self.scope.timed_whole, True
            try:
                yield
            finally:
                self.scope.timed_whole = was

    def seconds(self) -> float:
        if self._events:
            self._events[-1][1].synchronize()
            self._seconds += sum(s.elapsed_time(e) for s, e in self._events) / 1000
            self._events.clear()
        return self._seconds
