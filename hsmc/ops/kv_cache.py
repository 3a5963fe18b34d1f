"""One model's KV storage, indexed by the shared slot ids of `SlotAllocator`."""

from __future__ import annotations

import torch


class KVCache:
    """K and V of every layer for `num_slots` token slots, plus one trash slot for padding writes."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.num_slots = num_slots
        self.data = torch.zeros(num_layers, 2, num_slots + 1, num_kv_heads, head_dim, dtype=dtype, device=device)

    @property
    def trash_slot(self) -> int:
        return self.num_slots

    def keys(self, layer: int) -> torch.Tensor:
        return self.data[layer, 0]

    def values(self, layer: int) -> torch.Tensor:
        return self.data[layer, 1]
