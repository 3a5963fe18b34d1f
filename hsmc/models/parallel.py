"""Tensor parallelism inside a forward: which rank this is, and the collectives a sharded model calls.

A sharded `DecoderLM` follows gpt-fast's tp.py: each rank holds its heads of q/k/v and its slice of gate/up
(column-parallel, no communication), the matching input columns of o_proj and down_proj (row-parallel: one
all-reduce sums their partial products), and a slice of the vocabulary in the embedding (masked lookup, then an
all-reduce) and in the LM head (an all-gather to full logits, so sampling and the SMC weights see every token).
The group is handed to the model when it is built, never looked up globally; at world size 1 no collective runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group (`group`: the torch.distributed group of the device
    collectives, NCCL on CUDA, gloo on the CPU)."""

    rank: int = 0
    world_size: int = 1
    group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place (every rank gets the same bits)."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, size: int) -> torch.Tensor:
        """The ranks' x concatenated along the last dimension, cut to `size` (the padding of an uneven split)."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)[..., :size].contiguous()

    def lead(self, residual: torch.Tensor) -> torch.Tensor | None:
        """What a row-parallel Linear adds to its partial product: the residual on rank 0 only, so the all-reduce
        that follows adds it once (and the backend keeps fusing the add into the matmul)."""
        return residual if self.rank == 0 else None

    def vocab_rows(self, vocab_size: int) -> int:
        """Vocabulary rows per rank: ceil(V / N), the last rank's slice padded with zero rows."""
        return -(-vocab_size // self.world_size)


SINGLE = TensorParallel()


class VocabParallelEmbedding(nn.Embedding):
    """An embedding holding the rank's rows of the vocabulary: ids outside them look up zeros, and the all-reduce
    puts every id's row together (world size 1: a plain `nn.Embedding`)."""

    def __init__(self, vocab_size: int, dim: int, tp: TensorParallel) -> None:
        rows = tp.vocab_rows(vocab_size)
        super().__init__(rows, dim)
        self.tp, self.start = tp, tp.rank * rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return super().forward(ids)
        local = ids - self.start
        inside = (local >= 0) & (local < self.num_embeddings)
        out = F.embedding(torch.where(inside, local, 0), self.weight) * inside[..., None].to(self.weight.dtype)
        return self.tp.all_reduce(out)
