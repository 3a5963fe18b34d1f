"""An all-reduce for small tensors in one kernel and one trip over NVLink: every rank pushes its values into a slot
of every rank's buffer, then waits on its own buffer until all ranks' values are there, and sums them in rank
order (the same bits on every rank).

No barrier is needed because the values are their own flags (the "Lamport" scheme of TensorRT-LLM's one-shot
all-reduce): a free slot holds negative zero everywhere, a pushed value is never negative zero (-0.0 is pushed as
+0.0, which changes no sum but the sign of a zero one), so a rank knows a value has arrived when it reads
something else. After summing, a rank sets its slot back to negative zero. Calls rotate over three slots: a peer
can only push call i + 3 after this rank pushed its values of call i + 2, which it does after it finished (and
cleared) call i. The call number comes from a per-rank counter the programs of a call bump by `MAX_PROGRAMS` in
all, so the kernel replays inside CUDA graphs.

A call runs one program per `BLOCK` values (up to `MAX_PROGRAMS`): the pushes' latency over NVLink is hidden only
by bytes in flight, and a fixed 64 programs took 9.9 µs for a 72-row verify's activation (720 KiB).

One token's activation of a 32B (10 KiB) inside a CUDA graph on 2 x H200: this kernel 3.2 µs, torch's
symmetric-memory one-shot kernel (copy, barrier, read the peers, barrier) 6.7 µs, NCCL 12.9 µs
(`scripts/bench_tensor_parallel.py --parts all-reduce`; docs/measurements/2026-11-27-h100x2-tensor-parallel.txt).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

SLOTS = 3
MAX_PROGRAMS = 256  # a power of two: every call adds it to the counter, whatever its number of programs
BLOCK = 1024  # elements a program moves per step
FREE = {torch.bfloat16: -(1 << 15), torch.float32: -(1 << 31)}  # negative zero's bits, as the signed integer
BITS = {torch.bfloat16: torch.int16, torch.float32: torch.int32}
VALUES: dict[torch.dtype, Any] = {torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}  # Triton's name of each


@triton.jit
def _push_all_reduce(
    x_ptr,  # this rank's values, as integers of the dtype's width
    out_ptr,
    buffers_ptr,  # int64 [world]: every rank's buffer, [SLOTS, world, capacity] integers
    counter_ptr,  # int64 [1]: MAX_PROGRAMS x this rank's calls so far
    n,
    capacity,
    share,  # what each program adds to the counter: MAX_PROGRAMS over the call's programs
    rank: tl.constexpr,
    world: tl.constexpr,
    free: tl.constexpr,
    VALUE: tl.constexpr,  # the dtype the integers stand for
    SLOTS: tl.constexpr,
    MAX_PROGRAMS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    call = tl.atomic_add(counter_ptr, share) // MAX_PROGRAMS
    slot = call % SLOTS
    kind = x_ptr.dtype.element_ty
    for start in range(pid * BLOCK, n, programs * BLOCK):  # push everything first: one NVLink trip, not one a block
        offs = start + tl.arange(0, BLOCK)
        inside = offs < n
        x = tl.load(x_ptr + offs, mask=inside)
        x = tl.where(x == free, 0, x).to(kind)  # -0.0 would read as "not arrived"
        for peer in tl.static_range(world):
            theirs = tl.load(buffers_ptr + peer).to(tl.pointer_type(kind))
            tl.store(theirs + (slot * world + rank) * capacity + offs, x, mask=inside)
    mine = tl.load(buffers_ptr + rank).to(tl.pointer_type(kind))
    for start in range(pid * BLOCK, n, programs * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        inside = offs < n
        total = tl.zeros([BLOCK], dtype=tl.float32)
        for peer in tl.static_range(world):
            at = mine + (slot * world + peer) * capacity + offs
            got = tl.load(at, mask=inside, other=0, volatile=True)
            while tl.sum((got == free).to(tl.int32)) > 0:
                got = tl.load(at, mask=inside, other=0, volatile=True)
            total += got.to(VALUE, bitcast=True).to(tl.float32)
            tl.store(at, tl.full([BLOCK], free, kind), mask=inside)
        tl.store(out_ptr + offs, total.to(VALUE).to(kind, bitcast=True), mask=inside)


class PushAllReduce:
    """The buffers and counter of one group's push all-reduce for one dtype (bf16 or float32)."""

    def __init__(self, buffer: torch.Tensor, pointers: list[int], rank: int, dtype: torch.dtype) -> None:
        """`buffer`: this rank's [SLOTS, world, capacity] integers, set to FREE, every rank's mapped at `pointers`."""
        self.rank, self.world, self.dtype = rank, len(pointers), dtype
        self.capacity = buffer.shape[-1]
        self.buffer = buffer
        self.pointers = torch.tensor(pointers, dtype=torch.int64, device=buffer.device)
        self.counter = torch.zeros(1, dtype=torch.int64, device=buffer.device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        bits = BITS[self.dtype]
        programs = min(MAX_PROGRAMS, triton.next_power_of_2(triton.cdiv(x.numel(), BLOCK)))
        _push_all_reduce[(programs,)](
            x.view(bits), out.view(bits), self.pointers, self.counter, x.numel(), self.capacity,
            MAX_PROGRAMS // programs, rank=self.rank, world=self.world, free=FREE[self.dtype],
            VALUE=VALUES[self.dtype], SLOTS=SLOTS, MAX_PROGRAMS=MAX_PROGRAMS, BLOCK=BLOCK,
        )  # fmt: skip
        return out
