"""Tensor parallelism on 2 GPUs (NCCL, CUDA graphs capturing the all-reduces): every greedy stack kind decodes token
for token as one CPU process does, without a sync inside `generate`, and SMC stacks at T = 1 give the particles and
weights of one GPU. Tiny float32 models (TF32 off): differences are bugs, not rounding."""

from __future__ import annotations

import pytest
import torch

# fixtures: stacks, and exact_float32 (autouse: TF32 off)
from test_stacks_on_cuda import PROMPTS, decoder, exact_float32, stacks, without_syncs  # noqa: F401

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]


@pytest.mark.parametrize("kind", ["model", "rejection", "eagle3"])
def test_two_gpus_decode_greedily_as_the_cpu_without_a_sync(stacks, kind):  # noqa: F811
    want = [r.token_ids for r in decoder(stacks[kind], "cpu").generate(PROMPTS, max_new_tokens=24, ignore_eos=True)]
    sharded = decoder(stacks[kind], "cuda", tensor_parallel=2)
    try:
        sharded.generate(PROMPTS, max_new_tokens=24, ignore_eos=True)  # captures the graphs (a capture may sync)
        got = without_syncs(lambda: sharded.generate(PROMPTS, max_new_tokens=24, ignore_eos=True))
    finally:
        sharded.close()
    assert [r.token_ids for r in got] == want


@pytest.mark.parametrize("kind", ["smc", "hierarchical"])
def test_smc_on_two_gpus_gives_one_gpus_particles_and_weights(stacks, kind):  # noqa: F811
    one = decoder(stacks[kind], "cuda").generate(PROMPTS, max_new_tokens=24, ignore_eos=True)
    sharded = decoder(stacks[kind], "cuda", tensor_parallel=2)
    try:
        two = sharded.generate(PROMPTS, max_new_tokens=24, ignore_eos=True)
    finally:
        sharded.close()
    for a, b in zip(one, two):
        assert [p.token_ids for p in a.smc.particles] == [p.token_ids for p in b.smc.particles]
        assert (a.smc.chosen, a.smc.resamplings) == (b.smc.chosen, b.smc.resamplings)
        weights = [[p.log_weight for p in r.smc.particles] for r in (a, b)]
        assert weights[0] == pytest.approx(weights[1], abs=1e-4)
