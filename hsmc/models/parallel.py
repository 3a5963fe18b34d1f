"""Tensor parallelism inside a forward: which rank this is, and the collectives a sharded model calls.

A sharded `DecoderLM` follows gpt-fast's tp.py: each rank holds its heads of q/k/v and its slice of gate/up
(column-parallel, no communication), the matching input columns of o_proj and down_proj (row-parallel: one
all-reduce sums their partial products), and a slice of the vocabulary in the embedding (masked lookup, then an
all-reduce) and in the LM head (an all-gather to full logits, so sampling and the SMC weights see every token).
The group is handed to the model when it is built, never looked up globally; at world size 1 no collective runs.
On CUDA the all-reduces of small activations (decode, verify and SMC steps) go through `SymmetricAllReduce`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group (`group`: the torch.distributed group of the device
    collectives, NCCL on CUDA, gloo on the CPU)."""

    rank: int = 0
    world_size: int = 1
    group: Any = None
    symmetric: SymmetricAllReduce | None = None  # CUDA: the one-shot all-reduce of small tensors

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, the same bits on every rank: a new tensor where the symmetric all-reduce takes
        it, else x itself, summed in place by the group's backend."""
        if self.world_size == 1:
            return x
        if self.symmetric is not None and self.symmetric.takes(x):
            return self.symmetric(x)
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


class SymmetricAllReduce:
    """The all-reduce of small activations (decode, verify and SMC steps) over NVLink: `PushAllReduce`'s one kernel
    on buffers every rank maps through torch's symmetric memory. NCCL's ring takes ~13-16 µs for one token's
    activation inside a CUDA graph on 2 x H100; a step of Qwen3-32B runs 129 of them, which alone caps its TP=2
    decode near 1.65x. Tensors over `MAX_BYTES` (prefill chunks) go through NCCL; the crossover is measured by
    `scripts/bench_tensor_parallel.py --parts all-reduce`."""

    MAX_BYTES = 1 << 20  # a 32B's activation for 102 rows in bf16
    DTYPES = (torch.bfloat16, torch.float32)

    def __init__(self, group: Any, device: torch.device) -> None:
        """Collective: every rank of `group` builds it at the same time (the buffers' addresses are exchanged)."""
        from hsmc.ops.push_all_reduce import BITS, FREE, SLOTS, PushAllReduce  # Triton: CUDA installs only

        self.reducers = {}
        world = dist.get_world_size(group)
        for dtype in self.DTYPES:
            shape = (SLOTS, world, self.MAX_BYTES // dtype.itemsize)
            buffer = symm_mem.empty(shape, dtype=BITS[dtype], device=device).fill_(FREE[dtype])
            torch.cuda.synchronize(device)  # every slot free before any peer can push (after the rendezvous)
            handle = symm_mem.rendezvous(buffer, group.group_name)
            self.reducers[dtype] = PushAllReduce(buffer, _peer_addresses(buffer, handle, group), handle.rank, dtype)

    def takes(self, x: torch.Tensor) -> bool:
        return x.dtype in self.reducers and x.is_contiguous() and x.numel() * x.element_size() <= self.MAX_BYTES

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.reducers[x.dtype](x)


def _peer_addresses(buffer: torch.Tensor, handle: Any, group: Any) -> list[int]:
    """Where `buffer` lies on every rank. The handle gives each rank's base of the allocation holding `buffer`:
    `symm_mem.empty` starts one (offset 0) with torch's CUDA backend, but a backend that sub-allocates from a pool
    would not, so the offset is added, and checked equal on every rank (else pushes would land elsewhere)."""
    offset = buffer.data_ptr() - handle.buffer_ptrs[handle.rank]
    offsets: list[int | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(offsets, offset, group=group)
    if len(set(offsets)) > 1:
        raise RuntimeError(f"the symmetric buffers lie at different offsets on the ranks: {offsets}")
    return [base + offset for base in handle.buffer_ptrs]


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
