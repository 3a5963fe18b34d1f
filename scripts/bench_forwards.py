"""Single forwards of the Qwen3 shapes (random bf16 weights, Triton backend, CUDA graphs) against the time to read
their weights once (the roofline):

verify       one verify of 16 rows x 9 tokens on the 32B shape, and its largest GEMM (gate_up) alone by rows.
prefill      chunked prefill of 8 prompts of 512..4096 tokens on the 8B shape at several chunk budgets against one
             whole forward (time, peak activations, last-token logits).
capture      the time to capture the 8B's decode graphs (kernels compiled).
profile      the kernels of one 8B decode step (one row), grouped by name (torch.profiler).
profile-smc  the forwards of an SMC cycle by kernel (8B proposal step 8 x 1, 32B verify 8 x 9, the 8B's EAGLE3 head
             draft step 6 x 1), with and without programmatic dependent launch (the PDL-off run is the baseline).
vocab        what follows a forward over the 151,936-entry vocabulary: a Gumbel-max draw for 8 rows and the float64
             log-sum-exps of a 72-row verify (`hsmc.ops.vocab`), against the torch route and the logits' read.

    python scripts/bench_forwards.py [--parts verify,prefill,capture,profile,profile-smc,vocab] [--out DIR]

Decode tok/s against transformers and the roofline: `hsmc bench --shape qwen3-8b,qwen3-32b [--dtype fp8]`.
"""

from __future__ import annotations

import functools
import gc
import time

import torch
import triton.testing
from gpu_common import Report, run_parts

from hsmc.engine.kv_pool import BlockTables, SlotAllocator
from hsmc.engine.runner import ModelRunner
from hsmc.models.config import DecoderConfig
from hsmc.models.shapes import hf_config, random_model
from hsmc.models.size import weight_bytes
from hsmc.ops.triton_backend import TritonBackend


def runner_of(shape: str, rows: int, row_tokens: int) -> tuple[ModelRunner, BlockTables]:
    cfg = DecoderConfig.from_hf(hf_config(shape))
    tables = BlockTables(SlotAllocator(rows * row_tokens, "cuda"), rows, row_tokens)
    model = random_model(cfg, torch.bfloat16, "cuda")
    return ModelRunner(model, tables, TritonBackend(), cfg.num_layers, cuda_graphs=True), tables


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


def profile_forward(shape: str, rows_n: int, width: int, context: int, head: bool = False):
    """One forward (graph replay) of `rows_n` rows x `width` new tokens after `context` tokens of the random bf16
    `shape` (or of a random EAGLE3 head for it): (weights' bytes, wall ms per forward, {kernel: (us, launches)})."""
    from torch.profiler import ProfilerActivity, profile

    from hsmc.eagle.checkpoint import random_eagle3_head
    from hsmc.models.shapes import SHAPES

    cfg = DecoderConfig.from_hf(hf_config(shape))
    tables = BlockTables(SlotAllocator(rows_n * (context + 64), "cuda"), rows_n, context + 64)
    if head:
        model = random_eagle3_head(SHAPES[shape], "bfloat16", "cuda")[0]
        runner = ModelRunner(model, tables, TritonBackend(), 1, cuda_graphs=True)
    else:
        model = random_model(cfg, torch.bfloat16, "cuda")
        runner = ModelRunner(model, tables, TritonBackend(), cfg.num_layers, cuda_graphs=True)
    rows, full = torch.arange(rows_n, device="cuda"), torch.full((rows_n,), width, device="cuda")
    tokens = torch.randint(0, 1000, (rows_n, width), device="cuda")

    def inputs(n: int) -> dict:
        x = torch.randn(rows_n, n, cfg.hidden_size, dtype=torch.bfloat16, device="cuda")
        return {"embeds": x, "hidden": x.clone()} if head else {}

    step_inputs = inputs(width)

    def step():  # the same tokens again and again, rolled back after each forward
        runner.forward(runner.new_tokens(rows, tokens, full, context + width), True, **step_inputs)
        tables.rollback(rows, full, width)

    with torch.inference_mode():
        prompt = torch.randint(0, 1000, (rows_n, context), device="cuda")
        runner.forward(runner.new_tokens(rows, prompt, torch.full((rows_n,), context, device="cuda"), context), True,
                       **inputs(context))  # fmt: skip
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        wall_ms = triton.testing.do_bench(step, return_mode="median")
    kernels = {e.key: (e.device_time_total / 5, e.count // 5) for e in prof.key_averages() if e.device_time_total > 0}
    return weight_bytes(model), wall_ms, kernels


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


if __name__ == "__main__":
    parts = {"verify": verify, "prefill": prefill, "capture": capture, "profile": profile, "profile-smc": profile_smc,
             "vocab": vocab}  # fmt: skip
    run_parts(__doc__.split("\n\n")[0], parts, "bench_forwards")
