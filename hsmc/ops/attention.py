"""Attention over paged KV behind a small backend interface (mini-sglang style).

The torch reference backend is the CPU oracle: it gathers each row's keys through its block
table and runs SDPA with an explicit boolean mask. The mask is built in one place
(`causal_mask`) so a tree mask over the draft block can later be combined with it.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from hsmc.ops.batch import ForwardBatch
from hsmc.ops.kv_cache import KVCache


class AttentionBackend(Protocol):
    def prepare(self, batch: ForwardBatch) -> object:
        """Per-batch metadata shared by every layer (masks, indices)."""
        ...

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: KVCache,
        batch: ForwardBatch,
        meta: object,
    ) -> torch.Tensor:
        """Store k/v [R, T, Hkv, D] for the batch's tokens, then attend q [R, T, H, D]; returns [R, T, H, D]."""
        ...


def causal_mask(batch: ForwardBatch) -> torch.Tensor:
    """bool [R, 1, T, L]: query at position p sees the row's keys at positions <= p."""
    key_pos = torch.arange(batch.max_context, device=batch.positions.device)
    return (key_pos[None, None, :] <= batch.positions[:, :, None])[:, None]


class TorchAttention:
    """Reference backend: gather + SDPA, exact in fp32, any device."""

    def prepare(self, batch: ForwardBatch) -> torch.Tensor:
        return causal_mask(batch)

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache: KVCache,
        batch: ForwardBatch,
        meta: object,
    ) -> torch.Tensor:
        keys, values = cache.keys(layer), cache.values(layer)
        slots = batch.write_slots.reshape(-1)
        keys[slots] = k.reshape(-1, *k.shape[2:])
        values[slots] = v.reshape(-1, *v.shape[2:])
        context_k = keys[batch.key_slots].transpose(1, 2)  # [R, Hkv, L, D]
        context_v = values[batch.key_slots].transpose(1, 2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), context_k, context_v, attn_mask=meta, enable_gqa=True)
        return out.transpose(1, 2)
