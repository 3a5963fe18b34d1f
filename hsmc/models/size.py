"""Bytes of a model's weights: what one decode step reads, so the cost model and the benchmarks' rooflines count
them (random-weight shapes and loaded checkpoints alike)."""

from __future__ import annotations

import torch


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every distinct parameter (a tied embedding counts once)."""
    seen = {id(p): p.numel() * p.element_size() for p in model.parameters()}
    return sum(seen.values())
