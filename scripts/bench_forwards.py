"""Single forwards of the Qwen3 shapes (random bf16 weights, Triton backend, CUDA graphs) against the time to read
their weights once (the roofline):

verify       one verify of 16 rows x 9 tokens on the 32B shape, and its largest GEMM (gate_up) alone by rows.
prefill      chunked prefill of 8 prompts of 512..4096 tokens on the 8B shape at several chunk budgets against one
             whole forward (time, peak activations, last-token logits).
capture      the time to capture the 8B's decode graphs (kernels compiled).
profile      the kernels of one 8B decode step (one row), grouped by name (torch.profiler).
profile-fp8  issue 30 item 6: the forwards of a 16-request FP8 SMC cycle by kernel (FP8 weights and activations: the
             8B's proposal step 128 x 1, the 32B's verify 128 x 9) against their FP8 tensor-core bound and weight read.
profile-smc  the forwards of an SMC cycle by kernel (8B proposal step 8 x 1, 32B verify 8 x 9, the 8B's EAGLE3 head
             draft step 6 x 1), with and without programmatic dependent launch (the PDL-off run is the baseline).
profile-tp   issue 31: where a sharded forward loses against half of TP=1's time: the 8B's decode step (1 and 8
             rows) and the 32B's SMC verify (8 x 9) by kernel at TP=1 and at TP=N over all visible GPUs (rank 0).
vocab        what follows a forward over the 151,936-entry vocabulary: a Gumbel-max draw for 8 rows and the float64
             log-sum-exps of a 72-row verify (`hsmc.ops.vocab`), against the torch route and the logits' read.
tree-verify  issue 32: the 8B's verify over a draft tree's budget + 1 tokens (tree mask, positions by depth) and over
             a chain of as many, at 1, 4 and 8 rows, against the weight read; then the cost model's tok/s of [EAGLE3
             head -> 8B] and of the hierarchical stack [EAGLE3 head -> 8B -> 32B SMC, N = 8, K = 8] with a tree and
             with a chain of the same budget at the SmolLM2 head's measured acceptance.
tree-walk    issue 32: the walk of each tree rule over the Qwen3 vocabulary at 1 and 4 rows and budgets 8..64 (graph
             replays), torch (`hsmc.speculative.tree_verify`) and kernels (`hsmc.ops.tree_walk`), against the 8B's
             tree verify of the same size.

    python scripts/bench_forwards.py [--parts verify,prefill,capture,profile,profile-smc,profile-tp,vocab,tree-verify,
        tree-walk]
        [--out DIR]

Decode tok/s against transformers and the roofline: `hsmc bench --shape qwen3-8b,qwen3-32b [--dtype fp8]`.
"""

from __future__ import annotations

import functools
import gc
import time

import torch
import triton.testing
from gpu_common import FP8_PEAK_FLOPS, Report, layer_dims, on_every_rank, run_parts

from hsmc.engine.kv_pool import BlockTables, SlotAllocator
from hsmc.engine.runner import ModelRunner
from hsmc.models.config import DecoderConfig
from hsmc.models.parallel import SINGLE, TensorParallel
from hsmc.models.shapes import hf_config, random_model
from hsmc.models.size import weight_bytes
from hsmc.ops.fp8_linear import Fp8Linear
from hsmc.ops.triton_backend import TritonBackend

TIMED_STEPS = 50
TP_CASES = (  # shape, rows, new tokens per row, logits of the last token only
    ("qwen3-8b", 1, 1, True),
    ("qwen3-8b", 8, 1, True),
    ("qwen3-32b", 8, 9, False),
)


def runner_of(shape: str, rows: int, row_tokens: int, graphs: bool = True) -> tuple[ModelRunner, BlockTables]:
    cfg = DecoderConfig.from_hf(hf_config(shape))
    tables = BlockTables(SlotAllocator(rows * row_tokens, "cuda"), rows, row_tokens)
    model = random_model(cfg, torch.bfloat16, "cuda")
    return ModelRunner(model, tables, TritonBackend(), cfg.num_layers, cuda_graphs=graphs), tables


def verify(report: Report) -> None:
    report.say("== verify forward: 16 rows x 9 tokens after 128, Qwen3-32B shape ==")
    runner, tables = runner_of("qwen3-32b", 16, 1024)
    vocab = runner.module.config.vocab_size
    rows, nine = torch.arange(16, device="cuda"), torch.full((16,), 9, device="cuda")
    with torch.inference_mode():
        prompt = torch.randint(0, vocab, (16, 128), device="cuda")
        runner.forward(runner.new_tokens(rows, prompt, torch.full((16,), 128, device="cuda"), 128), last_only=True)
        tokens = torch.randint(0, vocab, (16, 9), device="cuda")

        def step():  # the same 9 tokens again and again, each verify rolled back after it
            runner.forward(runner.new_tokens(rows, tokens, nine, 137))
            tables.rollback(rows, nine, 9)

        step()
        ms = triton.testing.do_bench(step, return_mode="median")
    read_ms = report.read_ms(weight_bytes(runner.module))
    report.say(f"verify 16x9 on 32B: {ms:.2f} ms; weights once {read_ms:.2f} ms; {ms / read_ms:.2f}x the roofline",
               part="verify", ms=ms, weight_read_ms=read_ms)  # fmt: skip
    w = runner.module.model.layers[0].mlp.gate_up_proj.weight
    for m in (16, 64, 128, 144, 160, 256):
        x = torch.randn(m, w.shape[1], device="cuda", dtype=torch.bfloat16)
        gemm_ms = triton.testing.do_bench(lambda x=x: torch.nn.functional.linear(x, w), return_mode="median")
        bound = report.read_ms(w.numel() * 2)
        report.say(f"  32B gate_up [{w.shape[0]}x{w.shape[1]}] M={m}: {gemm_ms * 1e3:.0f} us, "
                   f"{bound / gemm_ms:.0%} of the weight read, {2 * m * w.numel() / gemm_ms / 1e9:.0f} TFLOP/s",
                   part="gate_up", rows=m, ms=gemm_ms, weight_read_ms=bound)  # fmt: skip


def prefill(report: Report) -> None:
    from hsmc.levels.base import SequenceState

    report.say("== chunked prefill: 8 prompts of 512..4096 tokens, Qwen3-8B shape, against one forward ==")
    rows_n, length = 8, 4096
    runner, _ = runner_of("qwen3-8b", rows_n, length + 64)
    rows = torch.arange(rows_n, device="cuda")
    lengths = [length - 512 * i for i in range(rows_n)]  # ragged: rows end in different chunks
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 150000, (n,), generator=gen).tolist() for n in lengths]
    measured = {}
    for budget in (2**40, 16384, 8192, 4096):  # one whole forward first: the baseline
        state = SequenceState(runner, rows_n, length + 64, prefill_chunk_tokens=budget)
        times = []
        with torch.inference_mode():
            for _ in range(3):
                state.release(rows)
                state.load_prompts(rows, prompts)
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                began = time.perf_counter()
                step = state.forward(rows, last_only=True)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - began)
                peak = torch.cuda.max_memory_allocated() - base
            measured[budget] = (sorted(times)[1] * 1e3, peak, step.logits[:, 0].float())
            state.release(rows)
    whole_ms, _, whole = measured[2**40]
    for budget, (ms, peak, logits) in measured.items():
        label = "one forward" if budget == 2**40 else f"chunks of {budget} tokens"
        agree = (logits.argmax(-1) == whole.argmax(-1)).float().mean().item()
        diff = (logits - whole).abs().max().item()
        report.say(f"prefill {sum(lengths)} tokens in {label}: {ms:.1f} ms ({sum(lengths) / ms * 1e3:.0f} tok/s, "
                   f"{ms / whole_ms:.2f}x one forward), peak activations {peak / 2**30:.2f} GiB; last-token argmax as "
                   f"one forward's {agree:.0%}, max |logit diff| {diff:.3g}",
                   budget=budget, ms=ms, peak_bytes=peak, argmax_equal=agree, max_abs_diff=diff)  # fmt: skip


def capture(report: Report) -> None:
    runner, _ = runner_of("qwen3-8b", 16, 8192)
    torch.cuda.synchronize()
    began = time.perf_counter()
    with torch.inference_mode():
        runner.graphs.capture(1, True, {})
    torch.cuda.synchronize()
    seconds = time.perf_counter() - began
    report.say(f"capture of the 8B decode graphs ({len(runner.graphs.captured)} buckets: rows "
               f"{runner.graphs.row_buckets} x context {runner.graphs.context_buckets}), kernels compiled: "
               f"{seconds:.1f} s", part="capture", seconds=seconds)  # fmt: skip


def forward_step(
    shape: str,
    rows_n: int,
    width: int,
    context: int,
    head: bool,
    graphs: bool,
    last_only: bool = True,
    fp8: bool = False,
    tp: TensorParallel = SINGLE,
):
    """(module, step): `step()` runs one forward of `rows_n` rows x `width` new tokens after `context` tokens (prefilled
    here) of the random bf16 `shape` (or of a random EAGLE3 head for it), rolled back after each call; `graphs`: the
    runner replays its own graphs (off: the caller captures `step` whole, as a graphed round holds its forwards);
    `last_only` False: the logits of every new token, as a verify; `fp8`: FP8 weights and activations (as
    `engine.fp8_activations`); `tp`: this rank's shard of the model."""
    from hsmc.eagle.checkpoint import random_eagle3_head
    from hsmc.models.shapes import SHAPES

    cfg = DecoderConfig.from_hf(hf_config(shape))
    tables = BlockTables(SlotAllocator(rows_n * (context + 64), "cuda"), rows_n, context + 64)
    if head:
        model = random_eagle3_head(SHAPES[shape], "bfloat16", "cuda")[0]
        runner = ModelRunner(model, tables, TritonBackend(), 1, cuda_graphs=graphs)
    else:
        model = random_model(cfg, torch.bfloat16, "cuda", fp8=fp8, tp=tp)
        runner = ModelRunner(model, tables, TritonBackend(), cfg.num_layers, cuda_graphs=graphs)
    for linear in (m for m in model.modules() if isinstance(m, Fp8Linear)):
        linear.dynamic_activations = True
    rows, full = torch.arange(rows_n, device="cuda"), torch.full((rows_n,), width, device="cuda")
    tokens = torch.randint(0, 1000, (rows_n, width), device="cuda")

    def inputs(n: int) -> dict:
        x = torch.randn(rows_n, n, cfg.hidden_size, dtype=torch.bfloat16, device="cuda")
        return {"embeds": x, "hidden": x.clone()} if head else {}

    step_inputs = inputs(width)

    def step():  # the same tokens again and again
        runner.forward(runner.new_tokens(rows, tokens, full, context + width), last_only, **step_inputs)
        tables.rollback(rows, full, width)

    with torch.inference_mode():
        prompt = torch.randint(0, 1000, (rows_n, context), device="cuda")
        runner.forward(runner.new_tokens(rows, prompt, torch.full((rows_n,), context, device="cuda"), context), True,
                       **inputs(context))  # fmt: skip
    return model, step


def profile_forward(
    shape: str,
    rows_n: int,
    width: int,
    context: int,
    head: bool = False,
    last_only: bool = True,
    fp8: bool = False,
    tp: TensorParallel = SINGLE,
):
    """One forward (graph replay) of `rows_n` rows x `width` new tokens after `context` tokens of the random bf16
    `shape` (or of a random EAGLE3 head for it; `last_only`, `fp8`, `tp` as in `forward_step`): (weights' bytes, wall
    ms per forward, {kernel: (us, launches)}). A fixed count of timed steps, so that the ranks of a sharded model
    replay their all-reduces equally often."""
    from torch.profiler import ProfilerActivity, profile

    model, step = forward_step(shape, rows_n, width, context, head, graphs=True, last_only=last_only, fp8=fp8, tp=tp)
    with torch.inference_mode():
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            if tp.world_size > 1:  # the ranks' profilers start at different times: a rank's first all-reduce would
                torch.distributed.barrier()  # time its wait for the others (3 ms in 2026-11-30's run 1), not its work
                torch.cuda.synchronize()
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        timed = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        timed[0].record()
        for _ in range(TIMED_STEPS):
            step()
        timed[1].record()
        timed[1].synchronize()
    wall_ms = timed[0].elapsed_time(timed[1]) / TIMED_STEPS
    kernels = {e.key: (e.device_time_total / 5, e.count // 5) for e in prof.key_averages() if e.device_time_total > 0}
    return weight_bytes(model), wall_ms, kernels


def head_ms(rows_n: int, width: int, context: int) -> float:
    """ms of the Qwen3-8B shape's EAGLE3 head over `rows_n` rows x `width` new tokens, replayed as one graph (as
    inside a graphed round: a wall-clock forward of a one-layer head is mostly the host's launches)."""
    _, step = forward_step("qwen3-8b", rows_n, width, context, head=True, graphs=False)
    with torch.inference_mode():
        step()
        return triton.testing.do_bench_cudagraph(step)


def say_profile(report: Report, label: str, nbytes: int, wall_ms: float, kernels: dict) -> None:
    """Under PDL a kernel's time includes its wait for the one before it: the sums overlap."""
    total = sum(us for us, _ in kernels.values())
    read_ms = report.read_ms(nbytes)
    report.say(f"{label}: {wall_ms:.3f} ms per forward, weight read {read_ms:.3f} ms ({read_ms / wall_ms:.0%} of the "
               f"roofline); kernels summed {total / 1e3:.2f} ms",
               forward=label, wall_ms=wall_ms, weight_read_ms=read_ms, kernels=kernels)  # fmt: skip
    for name, (us, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:14]:
        report.say(f"  {name[:60]:<60}{us / 1e3:8.3f} ms {us / total:6.1%}  x{n}")


def profile(report: Report) -> None:
    report.say("== one 8B decode step (1 row, 260 keys), by kernel (torch.profiler, graph replay) ==")
    say_profile(report, "8B, 1 row", *profile_forward("qwen3-8b", 1, 1, 259))


def profile_smc(report: Report) -> None:
    from hsmc.ops import pdl

    report.say("== the forwards of an SMC cycle (N=8, K=8), by kernel, with / without PDL ==")
    supported = pdl.pdl_supported
    try:
        for use_pdl in (True, False):
            pdl.pdl_supported = supported if use_pdl else functools.cache(lambda device: False)
            for shape, rows_n, width, head, label in (
                ("qwen3-8b", 8, 1, False, "8B proposal step, 8 x 1"),
                ("qwen3-32b", 8, 9, False, "32B verify, 8 x 9"),
                ("qwen3-8b", 6, 1, True, "EAGLE3 head of the 8B, draft step 6 x 1"),
            ):
                profiled = profile_forward(shape, rows_n, width, 259, head)
                say_profile(report, f"{label}, PDL {'on' if use_pdl else 'off'}", *profiled)
                gc.collect()
                torch.cuda.empty_cache()
    finally:
        pdl.pdl_supported = supported


def _profile_tp_rank(rank: int, world: int, init_method: str, results) -> None:
    """One rank of `profile_tp`: every case of `TP_CASES` on this rank's shard; rank 0 hands its profiles back."""
    from hsmc.engine.ranks import join

    ranks = join(rank, world, init_method, "cuda")
    profiled = []
    for shape, rows_n, width, last_only in TP_CASES:
        profiled.append(profile_forward(shape, rows_n, width, 259, last_only=last_only, tp=ranks.tp))
        gc.collect()
        torch.cuda.empty_cache()
    if rank == 0:
        results.put(profiled)
    ranks.leave()


def profile_tp(report: Report) -> None:
    world = torch.cuda.device_count()
    if world < 2:
        report.say(f"profile-tp: needs 2 or more GPUs, {world} visible")
        return
    single = []
    for shape, rows_n, width, last_only in TP_CASES:
        single.append(profile_forward(shape, rows_n, width, 259, last_only=last_only))
        gc.collect()
        torch.cuda.empty_cache()
    sharded = on_every_rank(_profile_tp_rank, world)
    report.say(f"== forwards by kernel at TP=1 and TP={world} (rank 0), graph replay; 'ideal' is half of TP=1 ==")
    for (shape, rows_n, width, _), one, many in zip(TP_CASES, single, sharded, strict=True):
        (bytes_1, ms_1, k_1), (bytes_n, ms_n, k_n) = one, many
        report.say(f"{shape} {rows_n} x {width}: {ms_1:.3f} ms at TP=1 ({report.read_ms(bytes_1) / ms_1:.0%} of its "
                   f"read), {ms_n:.3f} ms at TP={world} ({report.read_ms(bytes_n) / ms_n:.0%}; {ms_n / ms_1:.3f}x "
                   f"TP=1); kernels summed {sum(u for u, _ in k_1.values()) / 1e3:.3f} / "
                   f"{sum(u for u, _ in k_n.values()) / 1e3:.3f} ms",
                   case=f"{shape} {rows_n}x{width}", tp1_ms=ms_1, tpn_ms=ms_n, tp1=k_1, tpn=k_n)  # fmt: skip
        names = sorted(set(k_1) | set(k_n), key=lambda k: -max(k_1.get(k, (0, 0))[0], k_n.get(k, (0, 0))[0]))
        for name in names[:16]:
            (u1, n1), (un, nn) = k_1.get(name, (0.0, 0)), k_n.get(name, (0.0, 0))
            excess = un - u1 / world
            report.say(f"  {name[:58]:<58} {u1:9.1f} us x{n1:<4} {un:9.1f} us x{nn:<4} over ideal {excess:+8.1f} us")


def profile_fp8(report: Report) -> None:
    """Where the 16-request FP8 SMC cycle's time goes: each forward against 2 FLOP per weight and token at the FP8
    peak (the LM head in bf16 counted alike) and against its weight read."""
    from hsmc.ops import pdl

    report.say("== the forwards of a 16-request FP8 SMC cycle (N=8, K=8: 128 rows), by kernel, PDL off ==")
    supported = pdl.pdl_supported
    pdl.pdl_supported = functools.cache(lambda device: False)
    try:
        for shape, width, last_only, label in (("qwen3-8b", 1, True, "8B FP8 proposal step, 128 x 1"),
                                               ("qwen3-32b", 9, False, "32B FP8 verify, 128 x 9")):  # fmt: skip
            nbytes, wall_ms, kernels = profile_forward(shape, 128, width, 259, last_only=last_only, fp8=True)
            c = hf_config(shape)
            layer = sum(n * k for n, k in layer_dims(shape).values())
            params = c.num_hidden_layers * layer + c.hidden_size * c.vocab_size  # the Linears and the LM head
            bound_ms = 2 * params * 128 * width / FP8_PEAK_FLOPS * 1e3
            report.say(f"{label}: {wall_ms:.2f} ms, FP8 compute bound {bound_ms:.2f} ms ({bound_ms / wall_ms:.0%})",
                       forward=label, wall_ms=wall_ms, compute_bound_ms=bound_ms)  # fmt: skip
            say_profile(report, label, nbytes, wall_ms, kernels)
            gc.collect()
            torch.cuda.empty_cache()
    finally:
        pdl.pdl_supported = supported


def vocab(report: Report) -> None:
    import math

    from hsmc.ops.backend import TorchBackend
    from hsmc.ops.counter_hash import combine
    from hsmc.ops.vocab import gumbel_max, logsumexp_rows

    report.say("== vocabulary kernels over 151,936 logits (bf16) against the torch route ==")
    logits = (torch.randn(72, 151_936, device="cuda") * 3).to(torch.bfloat16)

    def per_row(value: float, rows: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.full((rows,), value, dtype=dtype, device="cuda")

    eight, keys = logits[:8], combine(torch.tensor(11, device="cuda"), torch.arange(8, device="cuda"))
    one, none = per_row(1.0, 8), per_row(-math.inf, 8)
    cases = {
        "draw, 8 rows": (lambda: gumbel_max(eight, one, none, keys),
                         lambda: TorchBackend().gumbel_max(eight, one, none, keys), eight),
        "float64 log-sum-exp, 72 rows": (lambda: logsumexp_rows(logits, per_row(1.0, 72, torch.float64),
                                                                per_row(-math.inf, 72)),
                                         lambda: torch.logsumexp(logits.double(), -1), logits),
    }  # fmt: skip
    for label, (kernels, reference, read) in cases.items():
        kernel_us = triton.testing.do_bench(kernels, return_mode="median") * 1e3
        torch_us = triton.testing.do_bench(reference, return_mode="median") * 1e3
        bound_us = report.read_ms(read.numel() * read.element_size()) * 1e3
        report.say(f"  {label}: kernels {kernel_us:.1f} us ({bound_us / kernel_us:.0%} of the logits' read, "
                   f"{bound_us:.1f} us); torch route {torch_us:.1f} us ({torch_us / kernel_us:.1f}x)",
                   case=label, kernel_us=kernel_us, torch_us=torch_us, roofline_us=bound_us)  # fmt: skip


TREES = {8: (4, 3), 16: (5, 4), 32: (6, 6), 64: (7, 10)}  # budget -> (depth, topk), scripts/tree_acceptance.py's
# Accepted tokens per verify (chain of γ = budget, the better tree rule) of the shipped SmolLM2 EAGLE3 head on 50 GSM8K
# questions at T = 1, docs/measurements/2026-11-28-cpu-tree-acceptance-50q.txt (64: not measured)
SMOLLM2_ACCEPTED = {8: (1.47, 1.57), 16: (1.47, 1.74), 32: (1.47, 1.78)}
SMC_PARTICLES, SMC_BLOCK = 8, 8  # the hierarchical stack's SMC level: N particles (the 8B's rows), K tokens a cycle


def random_tree(budget: int, depth: int, rows_n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A root and `budget` nodes, each under a random earlier node of depth < `depth`: (depth [R, N], seen [R, N, N],
    each node's ancestors and itself, parent [R, N]), the same tree in every row."""
    g = torch.Generator().manual_seed(budget)
    levels, parents, seen = [0], [0], torch.eye(budget + 1, dtype=torch.bool)
    for node in range(1, budget + 1):
        open_ = [n for n in range(node) if levels[n] < depth]
        parent = open_[int(torch.randint(len(open_), (1,), generator=g))]
        levels.append(levels[parent] + 1)
        parents.append(parent)
        seen[node] |= seen[parent]
    as_rows = (torch.tensor(levels)[None].expand(rows_n, -1), seen[None].expand(rows_n, -1, -1),
               torch.tensor(parents)[None].expand(rows_n, -1))  # fmt: skip
    return tuple(t.contiguous().cuda() for t in as_rows)


def verify_times(report: Report, rows_n: int, context: int) -> dict[tuple[int, bool], float]:
    """{(budget, tree): ms} of the 8B's verify of `rows_n` rows x budget + 1 tokens after `context` (graph replays)."""
    from dataclasses import replace

    from hsmc.levels.tree import tree_mask

    runner, tables = runner_of("qwen3-8b", rows_n, context + 128, graphs=False)
    read_ms = report.read_ms(weight_bytes(runner.module))
    rows, times = torch.arange(rows_n, device="cuda"), {}
    with torch.inference_mode():
        prompt = torch.randint(0, 1000, (rows_n, context), device="cuda")
        runner.forward(runner.new_tokens(rows, prompt, torch.full_like(rows, context), context), last_only=True)
        for budget, (depth, _) in TREES.items():
            n = budget + 1
            tokens, count = torch.randint(0, 1000, (rows_n, n), device="cuda"), torch.full_like(rows, n)
            levels, seen, _ = random_tree(budget, depth, rows_n)

            def step(tree: bool, tokens=tokens, count=count, n=n, levels=levels, seen=seen) -> None:
                batch = runner.new_tokens(rows, tokens, count, context + n)  # rolled back after each verify
                if tree:
                    mask = tree_mask(seen, batch.start, batch.max_context)
                    batch = replace(batch, positions=batch.start[:, None] + levels, mask=mask)
                runner.forward(batch)
                tables.rollback(rows, count, n)

            for tree in (False, True):
                step(tree)
                times[budget, tree] = triton.testing.do_bench_cudagraph(functools.partial(step, tree))
            chain_ms, tree_ms = times[budget, False], times[budget, True]
            report.say(f"  {rows_n} x {n:>2} tokens: chain {chain_ms:.3f} ms ({chain_ms / read_ms:.2f}x the weight "
                       f"read {read_ms:.3f} ms), tree {tree_ms:.3f} ms ({tree_ms / read_ms:.2f}x; "
                       f"{tree_ms / chain_ms:.2f}x the chain)", part="tree-verify", rows=rows_n, budget=budget,
                       chain_ms=chain_ms, tree_ms=tree_ms, weight_read_ms=read_ms)  # fmt: skip
    return times


def smc_verify_ms(report: Report, context: int) -> float:
    """ms of the 32B's verify of the SMC level's N particles x K + 1 tokens after `context` (graph replays)."""
    n = SMC_BLOCK + 1
    model, step = forward_step("qwen3-32b", SMC_PARTICLES, n, context, head=False, graphs=False, last_only=False)
    with torch.inference_mode():
        step()
        ms = triton.testing.do_bench_cudagraph(step)
    read_ms = report.read_ms(weight_bytes(model))
    report.say(f"  32B verify of {SMC_PARTICLES} x {n} tokens: {ms:.3f} ms ({ms / read_ms:.2f}x the weight read "
               f"{read_ms:.3f} ms)", part="smc-verify", ms=ms, weight_read_ms=read_ms)  # fmt: skip
    return ms


def round_ms(head: dict[int, float], verify_ms: dict[tuple[int, bool], float], budget: int) -> tuple[float, float]:
    """(chain, tree) round of [EAGLE3 head -> 8B] at `budget`: the head's forward over the new pairs (~2), its
    further draft steps (one token a row in a chain, the tree's `topk` a row), the verify."""
    depth, topk = TREES[budget]
    chain = head[2] + (budget - 1) * head[1] + verify_ms[budget, False]
    return chain, head[2] + (depth - 1) * head[topk] + verify_ms[budget, True]


def tree_verify(report: Report) -> None:
    from hsmc.cost_model import LevelCost, predict

    report.say("== verify of a draft tree (budget + 1 tokens) and of a chain of as many, 8B shape, after 256 tokens ==")
    context, verify_ms = 256, {}
    for rows_n in (1, 4, SMC_PARTICLES):
        verify_ms[rows_n] = verify_times(report, rows_n, context)
        gc.collect()
        torch.cuda.empty_cache()
    widths = sorted({1, 2, *(topk for _, topk in TREES.values())})
    head = {rows_n: {w: head_ms(rows_n, w, context) for w in widths} for rows_n in verify_ms}
    report.say("== cost model: [EAGLE3 head -> 8B] rounds at the SmolLM2 head's acceptance (T = 1), tree vs chain ==")
    for rows_n in (1, 4):
        for budget, (chain_accepted, tree_accepted) in SMOLLM2_ACCEPTED.items():
            depth, topk = TREES[budget]
            chain_ms, tree_ms = round_ms(head[rows_n], verify_ms[rows_n], budget)
            chain_tok_s, tree_tok_s = 1e3 * chain_accepted / chain_ms, 1e3 * tree_accepted / tree_ms
            report.say(f"  {rows_n} row(s), budget {budget}: chain {chain_accepted:.2f}/round in {chain_ms:.2f} ms "
                       f"= {chain_tok_s:.1f} tok/s; tree ({depth}, {topk}) {tree_accepted:.2f}/round in "
                       f"{tree_ms:.2f} ms = {tree_tok_s:.1f} tok/s ({tree_tok_s / chain_tok_s:.2f}x)",
                       part="tree-cost", rows=rows_n, budget=budget, chain_round_ms=chain_ms, tree_round_ms=tree_ms,
                       chain_tok_s=chain_tok_s, tree_tok_s=tree_tok_s)  # fmt: skip
    gc.collect()
    torch.cuda.empty_cache()
    report.say(
        f"== cost model: the hierarchical stack [EAGLE3 head -> 8B -> 32B SMC, N = {SMC_PARTICLES}, K = "
        f"{SMC_BLOCK}], one request, its blocks filled by tree or chain rounds at the same acceptance =="
    )
    smc = LevelCost("smc", smc_verify_ms(report, context), block_size=SMC_BLOCK, particles=SMC_PARTICLES)
    for budget, accepted in SMOLLM2_ACCEPTED.items():
        depth, topk = TREES[budget]
        tok_s = {}
        for (name, gamma), ms, length in zip(
            (("chain", budget), ("tree", depth)),
            round_ms(head[SMC_PARTICLES], verify_ms[SMC_PARTICLES], budget),
            accepted,
        ):
            rejection = LevelCost("rejection", ms, gamma=gamma, accepted_length=length, round_includes_drafts=True)
            tok_s[name] = predict([LevelCost("eagle3", head[SMC_PARTICLES][1]), rejection, smc]).tokens_per_s
        report.say(f"  budget {budget}: chain {tok_s['chain']:.1f} tok/s, tree ({depth}, {topk}) {tok_s['tree']:.1f} "
                   f"tok/s ({tok_s['tree'] / tok_s['chain']:.2f}x)", part="hierarchical-cost", budget=budget,
                   **{f"{k}_tok_s": v for k, v in tok_s.items()})  # fmt: skip


def tree_walk(report: Report) -> None:
    from hsmc.ops.tree_walk import tree_walk as walk_kernels
    from hsmc.speculative.tree_verify import verify_tree, verify_tree_traversal

    vocab_size = hf_config("qwen3-8b").vocab_size
    report.say(
        f"== the walk of each tree rule over {vocab_size} tokens (float32 p and q), graph replays: the torch walk "
        "(the reference) and the kernels (hsmc.ops.tree_walk), against the 8B's tree verify =="
    )
    for rows_n in (1, 4):
        verify_ms = verify_times(report, rows_n, 256)
        gc.collect()
        torch.cuda.empty_cache()
        for budget, (depth, _) in TREES.items():
            n = budget + 1
            _, _, parent = random_tree(budget, depth, rows_n)
            children = int(torch.bincount(parent[0, 1:]).max())
            tokens = torch.randint(0, vocab_size, (rows_n, n), device="cuda")
            p = torch.randn(rows_n, n, vocab_size, device="cuda").softmax(-1)
            q = (2 * torch.randn(rows_n, n, vocab_size, device="cuda")).softmax(-1)
            u = torch.rand(rows_n, n, device="cuda")
            tree_ms = verify_ms[budget, True]
            for rule in ("target_only", "draft_aware", "traversal"):
                drafter = None if rule == "target_only" else q
                torch_walk = verify_tree_traversal if rule == "traversal" else verify_tree
                times = {}
                for name, walk in (
                    ("torch", functools.partial(torch_walk, parent, tokens, p, drafter, u)),
                    ("kernels", functools.partial(walk_kernels, rule, parent, tokens, p, drafter, u, children)),
                ):
                    walk()
                    times[name] = triton.testing.do_bench_cudagraph(walk)
                report.say(f"  {rows_n} x {n:>2} nodes, {rule:>11}: torch {times['torch']:7.3f} ms "
                           f"({times['torch'] / tree_ms:.2f}x the verify {tree_ms:.3f} ms), kernels "
                           f"{times['kernels']:.3f} ms ({times['kernels'] / tree_ms:.3f}x; "
                           f"{times['torch'] / times['kernels']:.0f}x faster)", part="tree-walk", rows=rows_n,
                           budget=budget, rule=rule, tree_verify_ms=tree_ms, **times)  # fmt: skip
            del p, q
            gc.collect()
            torch.cuda.empty_cache()


if __name__ == "__main__":
    parts = {"verify": verify, "prefill": prefill, "capture": capture, "profile": profile, "profile-smc": profile_smc,
             "profile-fp8": profile_fp8, "profile-tp": profile_tp, "vocab": vocab,
             "tree-verify": tree_verify, "tree-walk": tree_walk}  # fmt: skip
    run_parts(__doc__.split("\n\n")[0], parts, "bench_forwards")
