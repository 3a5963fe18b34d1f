"""The push all-reduce kernel (`hsmc.ops.push_all_reduce`) as rank 0 of two, with the peer simulated: its values
are put in rank 0's slot before the call, and rank 0's push to it lands in a buffer of its own. Checked: the sum
in rank order, correctly rounded; -0.0 pushed as +0.0; the slot rotation over calls; every slot free again after
a call. Two real ranks on two GPUs: tests/gpu/test_tensor_parallel_on_cuda.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from hsmc.ops.push_all_reduce import BITS, FREE, MAX_PROGRAMS, SLOTS, PushAllReduce  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CAPACITY = 4096


def _pushed(x: torch.Tensor) -> torch.Tensor:
    """x's bits as a rank pushes them: -0.0 (a free entry) as +0.0."""
    bits = x.view(BITS[x.dtype])
    return bits.masked_fill(bits == FREE[x.dtype], 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rank_zero_of_two_sums_in_rank_order_and_frees_its_slots(dtype):
    bits = BITS[dtype]
    mine = torch.full((SLOTS, 2, CAPACITY), FREE[dtype], dtype=bits, device=DEVICE)
    peer = torch.full_like(mine, FREE[dtype])  # stands for rank 1's buffer: rank 0 pushes there
    reduce = PushAllReduce(mine, [mine.data_ptr(), peer.data_ptr()], rank=0, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    for call, n in enumerate([3000, 5, 1024, 2500, 4096]):  # more calls than slots, ragged sizes
        x0 = torch.randn(n, generator=g).to(dtype).to(DEVICE)
        x1 = torch.randn(n, generator=g).to(dtype).to(DEVICE)
        x0[:4] = torch.tensor([-0.0, -0.0, 1.0, -0.0])
        x1[:4] = torch.tensor([-0.0, 2.0, -0.0, 0.5])
        slot = call % SLOTS
        mine[slot, 1, :n] = _pushed(x1)  # rank 1's push, arrived before rank 0 looks
        out = reduce(x0)
        want = (_pushed(x0).view(dtype).double() + x1.double()).to(dtype)
        if DEVICE == "cpu" and dtype == torch.bfloat16:  # the interpreter truncates float32 to bf16 (CUDA rounds)
            assert ((out.view(bits).int() - want.view(bits).int()).abs() <= 1).all()
        else:
            assert torch.equal(out.view(bits), want.view(bits))
        assert torch.equal(peer[slot, 0, :n], _pushed(x0))
        peer[slot, 0, :n] = FREE[dtype]
        assert (mine == FREE[dtype]).all() and (peer == FREE[dtype]).all()
        assert reduce.counter.item() == (call + 1) * MAX_PROGRAMS  # whatever the call's number of programs
