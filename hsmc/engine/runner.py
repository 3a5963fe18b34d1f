"""Model runner: one model, its KV cache and an attention backend, over shared block tables."""

from __future__ import annotations

import torch

from hsmc.engine.kv_pool import BlockTables
from hsmc.models.decoder import DecoderLM, ForwardOutput
from hsmc.ops.attention import AttentionBackend, TorchAttention
from hsmc.ops.batch import ForwardBatch
from hsmc.ops.kv_cache import KVCache


class ModelRunner:
    def __init__(self, model: DecoderLM, tables: BlockTables, backend: AttentionBackend | None = None) -> None:
        cfg = model.config
        self.model = model
        self.tables = tables
        self.backend = backend or TorchAttention()
        self.cache = KVCache(
            cfg.num_layers, tables.allocator.num_slots, cfg.num_kv_heads, cfg.head_dim, model.dtype, tables.table.device
        )

    @property
    def device(self) -> torch.device:
        return self.tables.table.device

    @torch.inference_mode()
    def forward(
        self,
        rows: torch.Tensor,
        tokens: torch.Tensor,
        num_new: torch.Tensor,
        start: torch.Tensor,
        max_context: int,
        capture: tuple[int, ...] = (),
    ) -> ForwardOutput:
        """Process `tokens[i, :num_new[i]]` at positions `start[i]...` of `rows[i]` (see ForwardBatch.build)."""
        batch = ForwardBatch.build(self.tables.table, rows, tokens, num_new, start, max_context, self.cache.trash_slot)
        return self.model(batch, self.cache, self.backend, capture)
