"""Model runner: one paged model (a decoder LM or an EAGLE3 head), its KV cache and kernel backend.

Every model forward in hsmc goes through `ModelRunner.forward`: the levels' decode and verify steps,
the EAGLE3 head's drafting, and the verifier pass of EAGLE3 training. `new_tokens` turns per-row
token counts into a `ForwardBatch` (allocating their KV slots); `forward` runs it eagerly, or on CUDA
replays the graph captured for the batch's (rows bucket, tokens per row) shape (`CUDAGraphs`). A whole
rejection round or SMC cycle of several forwards may itself be captured (`RoundGraphs`); its forwards then
run eagerly inside that capture.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hsmc.engine.cuda_graphs import CUDAGraphs
from hsmc.engine.kv_pool import BlockTables
from hsmc.ops.backend import Backend
from hsmc.ops.batch import ForwardBatch
from hsmc.ops.kv_cache import KVCache


class ModelRunner:
    def __init__(
        self,
        module: nn.Module,
        tables: BlockTables,
        backend: Backend,
        num_layers: int,
        cuda_graphs: bool = False,
        **module_kwargs: Any,
    ) -> None:
        """`module_kwargs` are fixed arguments of every forward (e.g. `capture` for the layers an EAGLE3
        head reads); `cuda_graphs` replays captured graphs for the shapes that have one."""
        cfg = module.config
        self.module = module
        self.tables = tables
        self.backend = backend
        self.module_kwargs = module_kwargs
        dtype = next(module.parameters()).dtype
        device = tables.table.device
        self.cache = KVCache(num_layers, tables.allocator.num_slots, cfg.num_kv_heads, cfg.head_dim, dtype, device)
        self.graphs = CUDAGraphs(self) if cuda_graphs else None
        self.fixed_context: int | None = None  # set while a round or cycle is captured: every forward's context bound

    @property
    def device(self) -> torch.device:
        return self.tables.table.device

    def new_tokens(
        self, rows: torch.Tensor, tokens: torch.Tensor, num_new: torch.Tensor, max_context: int
    ) -> ForwardBatch:
        """A batch that appends tokens[i, :num_new[i]] to row rows[i]: slots are allocated at the end of each
        row's table, RoPE positions equal the columns, and padding writes to the trash slot."""
        slots, start, positions = self.tables.append(rows, num_new, tokens.shape[1])
        context = self.fixed_context or max(1, min(max_context, self.tables.max_row_tokens))
        return ForwardBatch(rows, self.tables.table, tokens, positions, slots, start, num_new, context)

    def forward(self, batch: ForwardBatch, last_only: bool = False, **inputs: torch.Tensor) -> tuple[Any, ...]:
        """The module's outputs for `batch` (rows first); graph outputs are views valid until the same
        shape is replayed again, so callers consume them within their step. While a round is captured
        (`fixed_context` set) it runs eagerly: graphs do not nest."""
        if self.graphs is not None and batch.mask is None and self.fixed_context is None:
            out = self.graphs.run(batch, last_only, inputs)
            if out is not None:
                return out
        return self.eager(batch, last_only, inputs)

    def eager(self, batch: ForwardBatch, last_only: bool, inputs: dict[str, torch.Tensor]) -> tuple[Any, ...]:
        return self.module(batch, self.cache, self.backend, last_only=last_only, **self.module_kwargs, **inputs)
