"""The Triton backend: the same steps as `TorchBackend`, each one fused kernel (`fused.py`), and paged
attention over the block tables (`paged_attention.py`). Selected by `engine.attention: triton`
(the default on CUDA); it also runs on the CPU under `TRITON_INTERPRET=1`, which is how the suite
checks it against the reference without a GPU."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hsmc.ops import fused
from hsmc.ops.backend import HeadLayout, Rope
from hsmc.ops.batch import ForwardBatch
from hsmc.ops.kv_cache import KVCache
from hsmc.ops.paged_attention import AttentionPlan, paged_attention, plan_attention


@dataclass(frozen=True)
class TritonMeta:
    rope: Rope
    plans: dict[tuple[int, int], AttentionPlan]  # by (heads, kv heads): a model has one layout


class TritonBackend:
    name = "triton"

    def __init__(self) -> None:
        self.sm_count = (
            torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
            if torch.cuda.is_available()
            else 4
        )

    def prepare(self, batch: ForwardBatch, rope: Rope, dtype: torch.dtype) -> TritonMeta:
        return TritonMeta(rope, {})

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return fused.add_rms_norm(x, None, weight, eps)[0]

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return fused.add_rms_norm(x, residual, weight, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return fused.silu_mul(gate_up)

    def qkv_to_cache(
        self,
        layer: int,
        qkv: torch.Tensor,
        heads: HeadLayout,
        qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None,
        cache: KVCache,
        batch: ForwardBatch,
        meta: TritonMeta,
    ) -> torch.Tensor:
        return fused.qkv_rope_store(
            qkv,
            heads.num_heads,
            heads.num_kv_heads,
            heads.head_dim,
            qk_norm,
            batch.positions,
            meta.rope.inv_freq,
            meta.rope.scale,
            batch.write_slots,
            cache.keys(layer),
            cache.values(layer),
        )

    def attend(
        self, layer: int, q: torch.Tensor, cache: KVCache, batch: ForwardBatch, meta: TritonMeta
    ) -> torch.Tensor:
        r, t, h, _ = q.shape
        keys = cache.keys(layer)
        key = (h, keys.shape[1])
        if key not in meta.plans:
            meta.plans[key] = plan_attention(r, t, batch.max_context, h, keys.shape[1], self.sm_count)
        out = paged_attention(
            q,
            keys,
            cache.values(layer),
            batch.table,
            batch.rows,
            batch.start,
            batch.num_new,
            meta.plans[key],
            batch.mask,
        )
        return out.view(r, t, -1)
