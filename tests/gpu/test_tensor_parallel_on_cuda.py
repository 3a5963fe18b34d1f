"""Tensor parallelism on 2 GPUs (NCCL, CUDA graphs capturing the all-reduces): every greedy stack kind decodes token
for token as one CPU process does, without a sync inside `generate`, and SMC stacks at T = 1 give the particles and
weights of one GPU. Tiny float32 models (TF32 off): differences are bugs, not rounding."""

from __future__ import annotations

import faulthandler
import json
import queue
import subprocess
import sys
import time

import pytest
import torch
import torch.multiprocessing as mp

# fixtures: stacks, and exact_float32 (autouse: TF32 off)
from test_stacks_on_cuda import ENGINE, PROMPTS, decoder, exact_float32, stacks, without_syncs  # noqa: F401

from hsmc.engine.ranks import join, local_init_method

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]


@pytest.mark.parametrize("kind", ["model", "rejection", "eagle3"])
def test_two_gpus_decode_greedily_as_the_cpu_without_a_sync(stacks, kind):  # noqa: F811
    want = [r.token_ids for r in decoder(stacks[kind], "cpu").generate(PROMPTS, max_new_tokens=24, ignore_eos=True)]
    sharded = decoder(stacks[kind], "cuda", tensor_parallel=2)
    try:
        assert sharded.ranks.tp.symmetric is not None, "the small all-reduces should run through the push kernel"
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


_DECODE_AND_EXIT = """
import faulthandler, json, sys
faulthandler.dump_traceback_later(200, exit=True)  # stuck (at exit too): where, in stderr, before the test's timeout
from hsmc.decoder import HierarchicalDecoder
config, close = json.loads(sys.argv[1]), sys.argv[2] == "close"
decoder = HierarchicalDecoder.from_config(config)
for _ in range(2):  # the second run replays the graphs the first captured
    decoder.generate([[3, 4, 5], [7]], max_new_tokens=16, ignore_eos=True)
if close:
    decoder.close()
print("decoded", flush=True)
"""


@pytest.mark.parametrize("close", ["close", "exit"])
def test_a_process_that_decoded_on_two_gpus_ends_closed_or_not(stacks, close):  # noqa: F811
    """The graphs of a TP=2 stack capture NCCL collectives (the LM head's all-gather), and NCCL (2.26 on) ends no
    communicator while such a graph lives: without releasing them first, both ranks waited in
    `destroy_process_group` forever, after `close()` or at exit (`hsmc bench` hung there on 2 x H100)."""
    config = {"levels": stacks["rejection"], "engine": {**ENGINE, "device": "cuda", "tensor_parallel": 2}}
    done = subprocess.run([sys.executable, "-c", _DECODE_AND_EXIT, json.dumps(config), close],
                          capture_output=True, text=True, timeout=240)  # fmt: skip
    assert "decoded" in done.stdout, done.stderr[-3000:]
    assert done.returncode == 0, done.stderr[-3000:]


def _inputs(rank: int, call: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank `rank`'s input to all-reduce number `call`: rows vary, so calls cover the push kernel and NCCL."""
    rows = (1, 8, 72, 300)[call % 4]
    g = torch.Generator().manual_seed(1000 * rank + call)
    return torch.randn(rows, 1024, generator=g).to(dtype)


def _all_reduce_back_to_back(rank: int, world: int, init_method: str, dtype: torch.dtype, results) -> None:
    faulthandler.dump_traceback_later(120, exit=True)  # a rank stuck in a collective prints where, and ends
    ranks = join(rank, world, init_method, "cuda")
    inputs = [_inputs(rank, call, dtype).cuda() for call in range(24)]
    stream = torch.cuda.Stream()  # warm-up off the capturing stream, as torch's graphs want
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        [ranks.tp.all_reduce(x.clone()) for x in inputs]
    torch.cuda.current_stream().wait_stream(stream)
    graph, copies = torch.cuda.CUDAGraph(), [x.clone() for x in inputs]
    with torch.cuda.graph(graph):
        outs = [ranks.tp.all_reduce(x) for x in copies]
    mismatched = []
    for replay in range(3):
        for x, y in zip(copies, inputs):
            x.copy_(y)
        graph.replay()
        torch.cuda.synchronize()
        for call, out in enumerate(outs):
            want = sum(_inputs(r, call, dtype).double() for r in range(world)).to(dtype)
            if not torch.equal(out.cpu(), want):
                mismatched.append((replay, call))
    results.put((rank, ranks.tp.symmetric is not None, mismatched))
    graph.reset()  # it captured NCCL all-reduces: NCCL ends no communicator while the graph lives
    ranks.leave()


def _result(results, procs, seconds: float = 300):
    """The next rank's result; a rank that died fails the test at once instead of leaving it waiting."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            return results.get(timeout=1)
        except queue.Empty:
            if dead := [p.exitcode for p in procs if p.exitcode not in (None, 0)]:
                pytest.fail(f"a rank exited with {dead[0]} (its traceback is in the captured stderr)")
    pytest.fail(f"no result within {seconds} s")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_all_reduces_back_to_back_in_a_graph_give_every_rank_the_exact_sum(dtype):
    """24 all-reduces of 1 to 300 rows replayed as one graph, three times: the push kernel reuses its buffer
    from call to call, so a rank that overwrote it before a peer had read it would show here as a wrong sum."""
    context = mp.get_context("spawn")
    results = context.Queue()
    init = local_init_method()
    procs = [context.Process(target=_all_reduce_back_to_back, args=(r, 2, init, dtype, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(_result(results, procs) for _ in procs)
    for p in procs:
        p.join()
    assert [(rank, symmetric) for rank, symmetric, _ in got] == [(0, True), (1, True)]
    assert [mismatched for *_, mismatched in got] == [[], []]
