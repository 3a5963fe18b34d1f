"""CUDA graphs for model forwards, one per (rows bucket, context bucket, tokens per row, last_only, inputs).

As in nano-vllm's model runner: each graph owns static input buffers; a replay copies the batch into
them (device-to-device, no host read), pads the unused rows of the bucket (they point at the block
tables' always-empty scratch row, bring no tokens and write to the trash slot) and replays. Outputs
are static tensors too, valid until that graph is replayed again. All graphs of a runner share one
memory pool (captured largest first, so smaller buckets reuse its blocks). The context bucket bounds
the rows' lengths, so attention is planned for it (how many splits along the context) and the torch
reference gathers only that many keys. A shape is captured on first use; `capture` does it ahead of
time so no capture (which synchronizes) happens mid-decode.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from hsmc.ops.batch import ForwardBatch

if TYPE_CHECKING:
    from hsmc.engine.runner import ModelRunner


def geometric_buckets(first: int, factor: int, last: int) -> list[int]:
    """first, first·factor, ... below `last`, then `last` itself."""
    buckets, b = [], first
    while b < last:
        buckets.append(b)
        b *= factor
    return [*buckets, last]


@contextmanager
def no_cyclic_gc() -> Iterator[None]:
    """Python's cycle collector off while a graph is captured: it may run at any allocation, and a dead decoder it
    frees (runners and their graphs reference each other) destroys CUDA graphs, which invalidates the capture
    ("operation not permitted when stream is capturing"; seen on an H200 after several decoders in one process)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclass
class CapturedForward:
    graph: torch.cuda.CUDAGraph
    batch: ForwardBatch  # static input buffers, [bucket rows, T]
    inputs: dict[str, torch.Tensor]
    outputs: tuple[Any, ...]


class CUDAGraphs:
    max_width = 32  # tokens per row: decode and verify steps; a prefill runs eagerly (once per request)

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.row_buckets = geometric_buckets(1, 2, runner.tables.max_rows)
        self.context_buckets = geometric_buckets(512, 4, runner.tables.max_row_tokens)
        self.pool = torch.cuda.graph_pool_handle()
        self.captured: dict[tuple, CapturedForward] = {}
        self.frozen = False  # after a warmup: a shape not captured runs eagerly instead of capturing mid-request

    def capture(self, width: int, last_only: bool, inputs: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
        """Capture every (rows, context) bucket for `width` tokens per row; `inputs` maps extra input names to
        the shape of one token's value and its dtype (e.g. an EAGLE3 head's `hidden`)."""
        for rows in sorted(self.row_buckets, reverse=True):
            for context in sorted(self.context_buckets, reverse=True):
                key = (rows, context, width, last_only, tuple(sorted(inputs)))
                if key not in self.captured:
                    self.captured[key] = self._capture(rows, context, width, last_only, inputs)

    def run(self, batch: ForwardBatch, last_only: bool, inputs: dict[str, torch.Tensor]) -> tuple[Any, ...] | None:
        """Replay the graph for the batch's shape (capturing its buckets first if needed); None when none fits."""
        r, width = batch.tokens.shape
        rows = next((b for b in self.row_buckets if b >= r), None)
        context = next((b for b in self.context_buckets if b >= batch.max_context), None)
        if rows is None or context is None or width > self.max_width:
            return None
        key = (rows, context, width, last_only, tuple(sorted(inputs)))
        if key not in self.captured:
            if self.frozen:
                return None
            specs = {name: (tuple(v.shape[2:]), v.dtype) for name, v in inputs.items()}
            self.capture(width, last_only, specs)
        cap = self.captured[key]
        s, tables = cap.batch, self.runner.tables
        s.rows[:r].copy_(batch.rows)
        s.rows[r:].fill_(tables.scratch_row)
        s.tokens[:r].copy_(batch.tokens)
        s.positions[:r].copy_(batch.positions)
        s.write_slots[:r].copy_(batch.write_slots)
        s.write_slots[r:].fill_(tables.allocator.trash_slot)
        s.start[:r].copy_(batch.start)
        s.start[r:].zero_()
        s.num_new[:r].copy_(batch.num_new)
        s.num_new[r:].zero_()
        for name, value in inputs.items():
            cap.inputs[name][:r].copy_(value)
        cap.graph.replay()
        return tuple(o[:r] if isinstance(o, torch.Tensor) else o for o in cap.outputs)

    def _capture(
        self,
        rows: int,
        context: int,
        width: int,
        last_only: bool,
        inputs: dict[str, tuple[tuple[int, ...], torch.dtype]],
    ) -> CapturedForward:
        runner, tables = self.runner, self.runner.tables
        device = tables.table.device
        zeros = torch.zeros(rows, width, dtype=torch.int64, device=device)
        batch = ForwardBatch(
            rows=torch.full((rows,), tables.scratch_row, dtype=torch.int64, device=device),
            table=tables.table,
            tokens=zeros.clone(),
            positions=zeros.clone(),
            write_slots=torch.full_like(zeros, tables.allocator.trash_slot),
            start=torch.zeros(rows, dtype=torch.int64, device=device),
            num_new=torch.zeros(rows, dtype=torch.int64, device=device),
            max_context=context,
        )
        static_inputs = {
            name: torch.zeros(rows, width, *shape, dtype=dtype, device=device)
            for name, (shape, dtype) in inputs.items()
        }
        warmup = torch.cuda.Stream()
        warmup.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(warmup):  # compiles kernels and sets up workspaces outside the capture
            runner.eager(batch, last_only, static_inputs)
        torch.cuda.current_stream().wait_stream(warmup)
        graph = torch.cuda.CUDAGraph()
        with no_cyclic_gc(), torch.cuda.graph(graph, pool=self.pool):
            outputs = runner.eager(batch, last_only, static_inputs)
        return CapturedForward(graph, batch, static_inputs, outputs)
