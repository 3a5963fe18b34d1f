"""Model runner: one paged model (a decoder LM or an EAGLE3 head), its KV cache and kernel backend.

Every model forward in hsmc goes through `ModelRunner.forward`: the levels' decode and verify steps,
the EAGLE3 head's drafting, and the verifier pass of EAGLE3 training. `new_tokens` turns per-row
token counts into a `ForwardBatch` (allocating their KV slots); `forward` runs it eagerly, or on CUDA
through the runner's forward unit (`Graphs`: rows padded to a bucket, one graph per rows × context bucket ×
tokens per row). A whole rejection round or SMC cycle holding the forward may be a graphed unit itself; while
it is captured the forward runs as plain code, planned for the capture's context bucket (`GraphScope`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hsmc.engine.graphs import Graphs, GraphScope, geometric_buckets
from hsmc.engine.kv_pool import BlockTables
from hsmc.ops.backend import Backend
from hsmc.ops.batch import ForwardBatch
from hsmc.ops.kv_cache import KVCache

MAX_GRAPH_WIDTH = 32  # tokens per row in a graphed forward: decode and verify steps; a prefill runs eagerly


def context_buckets(max_row_tokens: int) -> list[int]:
    """The context buckets graphs are captured for: 512, 2048, 8192, ... up to a row's capacity."""
    return geometric_buckets(512, 4, max_row_tokens)


class ModelRunner:
    def __init__(
        self,
        module: nn.Module,
        tables: BlockTables,
        backend: Backend,
        num_layers: int,
        cuda_graphs: bool = False,
        scope: GraphScope | None = None,
        prefix_run: int = 1,
        **module_kwargs: Any,
    ) -> None:
        """`module_kwargs` are fixed arguments of every forward (e.g. `capture` for the layers an EAGLE3
        head reads); `cuda_graphs` replays captured graphs for the shapes that have one; `scope`: the graph
        scope of the runner's stack (its own without one); `prefix_run`: the forwards' rows come in runs of this
        many that may share leading KV columns (`ForwardBatch.prefix_run`: an SMC stack's particles)."""
        cfg = module.layer_config  # a tensor-parallel rank's KV cache holds its own KV heads
        self.module = module
        self.tables = tables
        self.backend = backend
        self.module_kwargs = module_kwargs
        self.prefix_run = prefix_run
        dtype = next(module.parameters()).dtype
        device = tables.table.device
        self.cache = KVCache(num_layers, tables.allocator.num_slots, cfg.num_kv_heads, cfg.head_dim, dtype, device)
        self.scope = scope or GraphScope(context_buckets(tables.max_row_tokens))
        self.graphs = None
        if cuda_graphs:
            pads = (tables.scratch_row, None, None, tables.allocator.trash_slot, 0, 0)  # rows, tokens, ..., num_new
            row_buckets = geometric_buckets(1, 2, tables.max_rows)
            self.graphs = Graphs(self._planned, self.scope, row_buckets=row_buckets, pads=pads)

    @property
    def device(self) -> torch.device:
        return self.tables.table.device

    def new_tokens(
        self, rows: torch.Tensor, tokens: torch.Tensor, num_new: torch.Tensor, max_context: int
    ) -> ForwardBatch:
        """A batch that appends tokens[i, :num_new[i]] to row rows[i]: slots are allocated at the end of each
        row's table, RoPE positions equal the columns, and padding writes to the trash slot."""
        slots, start, positions = self.tables.append(rows, num_new, tokens.shape[1])
        context = self.scope.bucket or max(1, min(max_context, self.tables.max_row_tokens))
        return self._batch(rows, tokens, positions, slots, start, num_new, context)

    def forward(self, batch: ForwardBatch, last_only: bool = False, **inputs: torch.Tensor) -> tuple[Any, ...]:
        """The module's outputs for `batch` (rows first); graph outputs are views valid until the same
        shape is replayed again, so callers consume them within their step."""
        if self.graphs is None or batch.mask is not None or batch.tokens.shape[1] > MAX_GRAPH_WIDTH:
            return self.eager(batch, last_only, inputs)
        names = tuple(sorted(inputs))
        b = batch
        return self.graphs(
            b.rows, b.tokens, b.positions, b.write_slots, b.start, b.num_new, *(inputs[n] for n in names),
            longest=b.max_context, last_only=last_only, names=names,
        )  # fmt: skip

    def eager(self, batch: ForwardBatch, last_only: bool, inputs: dict[str, torch.Tensor]) -> tuple[Any, ...]:
        return self.module(batch, self.cache, self.backend, last_only=last_only, **self.module_kwargs, **inputs)

    def _planned(self, *tensors: torch.Tensor, last_only: bool, names: tuple[str, ...]) -> tuple[Any, ...]:
        """The forward unit: a batch's tensors and extra inputs (`names`), planned for the context bucket it runs in."""
        rows, tokens, positions, write_slots, start, num_new, *extras = tensors
        context = self.scope.bucket or self.tables.max_row_tokens
        batch = self._batch(rows, tokens, positions, write_slots, start, num_new, context)
        return self.eager(batch, last_only, dict(zip(names, extras)))

    def _batch(
        self,
        rows: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        write_slots: torch.Tensor,
        start: torch.Tensor,
        num_new: torch.Tensor,
        max_context: int,
    ) -> ForwardBatch:
        """A batch over this runner's tables, its rows in this runner's runs (`prefix_run`)."""
        table = self.tables.table
        return ForwardBatch(
            rows, table, tokens, positions, write_slots, start, num_new, max_context, prefix_run=self.prefix_run
        )
