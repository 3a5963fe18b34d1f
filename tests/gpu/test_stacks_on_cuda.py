"""Every stack kind on CUDA against the CPU and against itself: greedy tokens equal the CPU's, a seeded T = 1
request decodes the same with CUDA graphs as without them and alone as amid other requests, and nothing inside
`generate` synchronizes with the device (`torch.cuda.set_sync_debug_mode("error")` turns any sync into a failure
of the request). Tiny float32 models: differences are bugs, not rounding."""

from __future__ import annotations

import time
from unittest import mock

import pytest
import torch
from conftest import make_tiny_model
from helpers import assert_pools_empty
from test_eagle_checkpoint import published_layout
from test_eagle_level import SIZES

from hsmc.decoder import HierarchicalDecoder
from hsmc.levels.draft_length import IDLE_EVIDENCE
from hsmc.requests import SamplingParams

PROMPTS = [[3, 4, 5], [7], [9, 8, 7, 6, 5, 4, 3, 2], [11, 12]]
ENGINE = {"kv_capacity_tokens": 4096, "max_batch_rows": 32}
GREEDY_KINDS = ("model", "rejection", "eagle3", "tree", "eagle3-tree", "eagle3-traversal")  # smc has no greedy law
TREE = {"depth": 4, "topk": 2, "budget": 8}

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def stacks(tmp_path_factory):
    root = tmp_path_factory.mktemp("cuda_stacks")
    small, big = make_tiny_model("llama", root / "s", seed=1), make_tiny_model("llama", root / "b", seed=2)
    head, _ = published_layout(root / "head", dtype=torch.float32, sizes=(*SIZES, 101, 40), scale=0.3)
    small, big, head = str(small), str(big), str(head)
    return {
        "model": [{"model": big}],
        "rejection": [{"model": small}, {"kind": "rejection", "model": big, "num_draft_tokens": 4}],
        "eagle3": [{"kind": "eagle3", "model": head}, {"kind": "rejection", "model": big}],
        "tree": [{"model": small}, {"kind": "rejection", "model": big, "tree": TREE}],
        "eagle3-tree": [{"kind": "eagle3", "model": head, "temperature": 1.0},
                        {"kind": "rejection", "model": big, "tree": TREE, "tree_rule": "draft_aware"}],
        "eagle3-traversal": [{"kind": "eagle3", "model": head, "temperature": 1.0},
                             {"kind": "rejection", "model": big, "tree": TREE, "tree_rule": "traversal"}],
        "smc": [{"model": small, "temperature": 1.0},
                {"kind": "smc", "model": big, "temperature": 1.0, "particles": 4, "block_size": 3}],
        "hierarchical": [{"kind": "eagle3", "model": head, "temperature": 1.0},
                         {"kind": "rejection", "model": small, "temperature": 1.0},
                         {"kind": "smc", "model": big, "temperature": 1.0, "particles": 4, "block_size": 6}],
    }  # fmt: skip


def decoder(levels, device: str, **engine) -> HierarchicalDecoder:
    return HierarchicalDecoder.from_config({"levels": levels, "engine": {**ENGINE, "device": device, **engine}})


def without_syncs(run):
    """run() with every synchronizing CUDA call an error (on the driver's thread too: the mode is global)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        return run()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.fixture(autouse=True)
def exact_float32():
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = tf32


@pytest.mark.parametrize("kind", GREEDY_KINDS)
def test_greedy_on_cuda_equals_the_cpu_without_a_sync(stacks, kind):
    cpu = decoder(stacks[kind], "cpu")
    want = [r.token_ids for r in cpu.generate(PROMPTS, max_new_tokens=24, ignore_eos=True)]
    cuda = decoder(stacks[kind], "cuda")
    cuda.generate(PROMPTS, max_new_tokens=24, ignore_eos=True)  # captures the graphs (a capture may sync)
    got = without_syncs(lambda: cuda.generate(PROMPTS, max_new_tokens=24, ignore_eos=True))
    assert [r.token_ids for r in got] == want
    cuda.driver.quiesce()
    assert_pools_empty(cuda)


@pytest.mark.parametrize("kind", ["rejection", "eagle3"])
def test_auto_draft_length_times_replays_and_decodes_the_cpus_greedy_tokens(stacks, kind):
    """`num_draft_tokens: auto` on CUDA: every γ's round time at start is positive and, with one row, a round of 8
    drafts costs more than one of none (on an H100 a timing once included a graph capture and came out negative, so
    auto took γ = 8 at 0.09-0.16x the target alone), and at T = 0 the tokens are the CPU's greedy ones, without a
    sync. At 32 rows of these tiny models the host's work per request bounds a round alike for every γ (1.04-1.32 ms
    for γ = 0..8 on an H200, in no order), so only one row's times have one."""
    *below, top = stacks[kind]
    auto = [*below, {**top, "num_draft_tokens": "auto"}]
    want = [r.token_ids for r in decoder(stacks[kind], "cpu").generate(PROMPTS, max_new_tokens=24, ignore_eos=True)]
    cuda = decoder(auto, "cuda")
    times = cuda.stack.top.draft_length.round_ms
    ordered = {rows: min(ms) > 0 and (rows > 1 or ms[-1] > ms[0]) for rows, ms in times.items()}
    wrong = {rows: [round(t, 3) for t in ms] for rows, ms in times.items() if not ordered[rows]}
    assert not wrong, f"round times (ms, γ = 0..8) out of order at these batch sizes: {wrong}"
    cuda.generate(PROMPTS, max_new_tokens=24, ignore_eos=True)  # captures the batch's shapes (a capture may sync)
    got = without_syncs(lambda: cuda.generate(PROMPTS, max_new_tokens=24, ignore_eos=True))
    assert [r.token_ids for r in got] == want
    cuda.driver.quiesce()
    assert_pools_empty(cuda)


@pytest.mark.parametrize("kind", ["rejection", "eagle3"])
def test_auto_that_never_drafts_replays_rounds_without_the_drafter_and_draws_the_eagers_tokens(stacks, kind):
    """`num_draft_tokens: auto` whose round times make it never draft (no γ pays at α = 0.5 and the catch-up
    exceeds the probes' share): its rounds leave the drafter out, replay one graph captured by `warmup()` (none runs
    eagerly) without a sync and draw the eager decoder's tokens for the same seeds at T = 1, longer than an EAGLE3
    head's window, with no drafting round."""
    *below, top = stacks[kind]
    auto = [*below, {**top, "num_draft_tokens": "auto", "temperature": 1.0}]
    params = [SamplingParams(seed=s, max_tokens=90, ignore_eos=True) for s in (3, 4, 5, 6)]

    def untimed(warm: bool = False, **engine) -> HierarchicalDecoder:  # times set below, not timed (minutes here)
        with mock.patch.object(HierarchicalDecoder, "_time_rounds", lambda self, level: None):
            d = decoder(auto, "cuda", **engine)
        if warm:
            d.warmup(progress=False)
        choice = d.stack.top.draft_length
        choice.round_ms = {n: [0.75, 2.03, 2.40, 2.14, 2.31, 2.63, 2.84, 2.95, 10.3] for n in (1, 4)}
        choice.catch_up_ms = {1: 0.03, 4: 0.03}
        for _ in range(IDLE_EVIDENCE):  # enough drafts read to go idle for good, α left at the prior 0.5
            choice.observe(1, [0])
        choice.kept, choice.rejected = 1.0, 1.0
        return d

    def run(d: HierarchicalDecoder) -> list[list[int]]:
        return [r.token_ids for r in d.generate(PROMPTS, params=params)]

    eager = run(untimed(cuda_graphs=False))
    graphed = untimed(warm=True, max_batch_rows=len(PROMPTS))
    assert without_syncs(lambda: run(graphed)) == eager
    level = graphed.stack.top
    assert level.idle_drafter and level.bare_rounds.replays > 80 and level.bare_rounds.missed == 0
    assert level.drafted == 0
    graphed.driver.quiesce()
    assert_pools_empty(graphed)


@pytest.mark.parametrize("kind", ["rejection", "eagle3"])
def test_auto_rounds_of_any_gamma_at_t1_decode_the_same_graphed_as_eager(stacks, kind):
    """`num_draft_tokens: auto` at T = 1 with γ on a schedule of long streaks of 0 (the drafter sits them out and
    catches up at the next draft: a `model` drafter's tokens, an EAGLE3 head's pairs): after `warmup()` the graphed
    decoder replays its rounds of γ = 0 without a sync and draws the eager decoder's tokens for the same seeds."""
    *below, top = stacks[kind]
    auto = [*below, {**top, "num_draft_tokens": "auto", "temperature": 1.0}]  # the law `warmup()` captures
    schedule = [0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 1, 0, 3, *[0] * 12, 4, 0, 1]
    params = [SamplingParams(seed=s, max_tokens=40, ignore_eos=True) for s in (3, 4, 5, 6)]

    def run(d: HierarchicalDecoder) -> list[list[int]]:
        picks = iter(schedule * 20)
        choice = d.stack.top.draft_length
        choice.round_ms = dict(choice.round_ms)  # times set anew: a choice the warmup left idle drafts again
        choice.choose = lambda rows: next(picks)
        return [r.token_ids for r in d.generate(PROMPTS, params=params)]

    eager = run(decoder(auto, "cuda", cuda_graphs=False, max_batch_rows=len(PROMPTS)))
    graphed = decoder(auto, "cuda", max_batch_rows=len(PROMPTS))  # the warmup captures no bucket above 4 rows
    graphed.warmup(progress=False)
    assert without_syncs(lambda: run(graphed)) == eager
    level = graphed.stack.top
    assert level.bare_rounds.replays > 0  # the rounds of γ = 0 replay (a drafting round after a streak may run
    # eagerly: its drafter's backlog is a shape the warmup does not foresee)
    graphed.driver.quiesce()
    assert_pools_empty(graphed)


@pytest.mark.parametrize("kind", [*GREEDY_KINDS, "smc", "hierarchical"])
def test_seeded_request_is_the_same_graphed_eager_alone_and_amid_others(stacks, kind):
    mine = SamplingParams(seed=42, max_tokens=24, ignore_eos=True, temperature=0.9, top_p=0.95)
    others = [SamplingParams(seed=s, max_tokens=m, ignore_eos=True) for s, m in ((1, 5), (2, 31), (3, 12))]
    batch = [[9], [1, 2, 3], [3, 4, 5], [6]]
    eager = decoder(stacks[kind], "cuda", cuda_graphs=False).generate([[3, 4, 5]], params=mine)[0]
    graphed = decoder(stacks[kind], "cuda")
    graphed.generate(batch, params=[others[0], others[1], mine, others[2]])  # captures
    alone = without_syncs(lambda: graphed.generate([[3, 4, 5]], params=mine))[0]
    amid = without_syncs(lambda: graphed.generate(batch, params=[others[0], others[1], mine, others[2]]))[2]
    assert alone.token_ids == eager.token_ids
    assert amid.token_ids == alone.token_ids
    graphed.driver.quiesce()
    assert_pools_empty(graphed)


def test_after_warmup_no_cycle_runs_without_a_graph_whatever_the_acceptance_law(stacks, monkeypatch):
    """Issue 29 §4 on the device: after `warmup()` of [EAGLE3 head, rejection, smc] with a block fill, one request and
    a full batch (8 rows: 2 requests of 4 particles) whose acceptance laws plan every R a block may take replay every
    cycle (none runs eagerly, none captures: no sync), and their tokens are those of the same requests on an eager
    decoder. Prints the warmup's time and captures."""
    from hsmc.levels.block_fill import geometric_yield_law

    graphed = decoder(stacks["hierarchical"], "cuda", max_batch_rows=8)
    began = time.perf_counter()
    graphed.warmup(progress=False)
    seconds = time.perf_counter() - began
    units = graphed.stack.scope.units
    print(f"warmup {seconds:.1f} s, {sum(len(u.captured) for u in units)} graphs ({len(units)} units)")
    top, fill = graphed.stack.top, graphed.stack.levels[1].fill
    eager = decoder(stacks["hierarchical"], "cuda", cuda_graphs=False, max_batch_rows=8)
    for d in (graphed, eager):  # the law stays what is set below
        monkeypatch.setattr(d.stack.levels[1].fill, "observe", lambda values: None)
    params = [SamplingParams(seed=s, max_tokens=20, ignore_eos=True) for s in (5, 6)]
    plans = set()
    for mean in (1.0, 1.8, 2.6, 3.4, 4.2, 5.0):
        for d in (graphed, eager):
            d.stack.levels[1].fill.law = geometric_yield_law(mean, fill.gamma)
        plans.add(fill.planned)
        for n in (1, 2):
            got = without_syncs(lambda: graphed.generate([[3, 4, 5], [6, 7, 8, 9]][:n], params=params[:n]))
            want = eager.generate([[3, 4, 5], [6, 7, 8, 9]][:n], params=params[:n])
            assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert len(plans) >= 4 and top.cycle_graphs.missed == 0 and top.cycle_graphs.replays > 0
    graphed.driver.quiesce()
    assert_pools_empty(graphed)
