"""One-call GPU check of the engine: correctness against the CPU oracle, then speed against the roofline.

    python scripts/gpu_engine_check.py --out DIR [--sections kernels,tiny,smollm2,bench,verify,profile]
        [--gguf PATH]

vocab    the one-pass vocabulary kernels (Gumbel-max draws, float64 log-sum-exps) against the exact law and torch
         over 151,936 logits, and their time against the torch route.
kernels  compiled Triton kernels vs the torch reference on the GPU: paged attention over ragged random
         batches with contexts up to 8k (decode, verify, prefill chunks; bf16/fp16/fp32; GQA 4 and 8),
         each fused kernel in bf16 (in last-place units), and the decode attention's achieved bandwidth.
tiny     tiny Llama/Qwen2/Qwen3 (fp32): logits of hsmc on CUDA (Triton + CUDA graphs) vs transformers on
         the CPU; greedy decoding of a model, a [draft, rejection] and an [eagle3, rejection] stack on
         CUDA equal to the CPU reference token for token, with torch.cuda.set_sync_debug_mode("error")
         around the whole generate() call after a warm-up.
smollm2  the real SmolLM2-135M-Instruct (from --gguf): greedy CUDA == CPU on the demo prompts.
bench    `hsmc bench` numbers: Qwen3-8B shape at batch 1/4/16 and Qwen3-32B at batch 1 (random bf16
         weights, 128-token prompts, 256 new tokens), transformers eager generate as the baseline, the
         roofline from the measured copy bandwidth; graph capture time of the 8B buckets.
verify   one verify forward of 16 rows x 9 tokens on the 32B shape vs the time to read its weights once.
profile  the kernels of one 8B decode step, grouped, from torch.profiler.
smcsync  tiny SMC stacks ([model|eagle3, (rejection, (rejection,)) smc], and with a stop string) on CUDA
         after a warm-up under torch.cuda.set_sync_debug_mode: the synchronizing calls of generate() (the
         cycle's one read waits on an event: expected none); near-greedy (T = 1e-4) tokens CUDA == CPU; at
         T = 1 the same seed twice on CUDA gives the same tokens.
smcbench `hsmc bench --config` of configs/bench/{smc,hierarchical,selfdraft}_8b_32b.yaml at 1/4/16
         requests (random bf16 weights, 64-token prompts, 64 new tokens): tok/s per request and in all,
         cycle vs weight-read bound, per-level times, cost model (also at accepted length 3.5). The target is
         the 32B shape where the GPU holds it (≥ 120 GB: H200), else the 14B shape (H100), as printed.
rounds   rejection rounds captured as CUDA graphs (`Graphs`): configs/bench/eagle3_8b.yaml at 1/4/16
         requests (64-token prompts, 128 new tokens), graphed vs eager rounds in the same run; then tiny
         [model|eagle3, rejection(, rejection)(, smc)] stacks on CUDA (SMC cycles eager, as with stop strings)
         after a warm-up: replayed rounds, synchronizing calls, T = 1e-4 tokens CUDA == CPU, T = 1 graphed ==
         eager rounds (same seed).
cycles   SMC cycles captured as CUDA graphs (`SMCLevel.cycle_graphs`, a block fill's rounds inside):
         configs/bench/{smc,hierarchical}_8b_32b.yaml (and smc at N=6 K=16) at 1/4/16 requests, graphed vs
         eager cycles in the same run (`bench_stack` times both), the cycle graphs' memory pool against the KV
         reserve's estimate; then the tiny SMC stacks of smcsync (continuous batching, mixed N): replayed
         cycles, synchronizing calls, T = 1e-4 tokens CUDA == CPU, T = 1 graphed == eager cycles (same seed).
fp8gemm  the Triton weight-only FP8 GEMM vs the dequantized fp32 reference over the 32B/8B Linears at
         M = 1..512 rows (> 256: dequantize + cuBLAS), timed against bf16 cuBLAS on the same weights, and a
         sweep of launch settings at M = 1.
fp8decode batch-1 decode of the qwen3-8b and qwen3-32b shapes with FP8 weights, % of the FP8 roofline
         (weight bytes incl. scales / copy bandwidth), and bf16 in the same run (`hsmc bench --dtype fp8`).
fp8logits qwen3-8b shape: the FP8 model vs the bf16 model on its dequantized weights, max/mean logit diff.
fp8stack the headline stack's shapes (FP8 32B + FP8 8B + an EAGLE3 head of the real shape), KV auto-sized,
         a few SMC cycles; torch.cuda.max_memory_allocated (an H100's 80 GB emulated on a larger GPU).
fp8rss   a random 32B-shape FP8 checkpoint (~34 GB, 4 GB shards) written to a temp folder and streamed onto
         the GPU in a fresh process: peak CPU RSS growth vs the largest shard.
linears  the decoder-layer Linears of qwen3-8b (bf16) and qwen3-32b / qwen3-8b (FP8) at one row, all layers chained
         in one CUDA graph: the separate norm / SiLU / add kernels around cuBLAS against the fused one-row
         kernels with and without programmatic dependent launch, and a sweep of tile settings per Linear.
fewlinears the qwen3-8b and qwen3-32b decoder-layer Linears (bf16) at 1, 2, 4, 8 and 16 rows, all layers chained in
         one CUDA graph: the few-row kernels' rounding against the torch reference, a sweep of their tile settings
         per Linear (and the 8B LM head) at 8 rows, the whole chain on the current path (one row: the one-row
         kernels; more: the few-row kernels) against norm / SiLU kernels + cuBLAS and against the sweep's best
         settings, and the whole 8B forward at 1..16 rows with the few-row kernels and with cuBLAS.
fewplans the measured few-row plans for this GPU (`few_row_linear.MEASURED_PLANS`): the qwen3-8b Linears and LM head
         swept at 8 and 32 rows (median of 3 interleaved rounds), the table entries printed, then the Linears chained
         and the whole 8B step at 2..32 rows, the default route (cuBLAS past 16 rows) against the measured plans.
decodeattn the whole qwen3-8b one-row forward (graph replay) with the attention plan forced to each split / key
         block / warps setting, at 260 and 2000 keys.
attnvar  decode attention (one query token per row; G = 4 and 8, 8-32 rows, 300-4400 keys) and
verifyattn verify attention (9 tokens per row; 268-4400 keys): the planner's plan against every split / key block /
         warps setting, 16 calls replayed in one graph each.
profilesmc the 8B proposal step (8 rows) and the 32B verify (8 x 9) of an SMC cycle by kernel (torch.profiler),
         with and without PDL.
cyclekernels one request through configs/bench/smc_8b_32b.yaml (N=8 K=8, N=6 K=16): the kernels of a graphed SMC cycle
         by kind (torch.profiler), how many run outside the forwards (bookkeeping, SMC math), the GPU's idle time.
prefill  chunked prefill of 8 prompts of 512..4096 tokens on the 8B shape at several chunk budgets (time, peak
         activations, last logits against one forward); tiny stacks with chunks that replay decode graphs, CUDA
         greedy == CPU.
verifygemm cuBLAS routes (x·Wᵀ, W·xᵀ, the weight stored [K, N], padded tokens) for the 32B's Linears at 72 and 144.
`--device cpu --tiny` runs the fp8 sections at small shapes on the CPU (a dry run; the suite does it).
Results are printed and written to DIR (results.json, summary.txt).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from conftest import TINY_CONFIGS, make_tiny_model, save_tokenizer  # noqa: E402
from test_eagle_checkpoint import published_layout  # noqa: E402

from hsmc.bench import bench_stack, config_for_bench, copy_bandwidth, format_stack_table, run_bench, timed, to_json  # noqa: E402
from hsmc.config import load_config  # noqa: E402
from hsmc.decoder import HierarchicalDecoder  # noqa: E402
from hsmc.engine.kv_pool import BlockTables, SlotAllocator  # noqa: E402
from hsmc.engine.runner import ModelRunner  # noqa: E402
from hsmc.models.config import DecoderConfig  # noqa: E402
from hsmc.models.loading import load_model  # noqa: E402
from hsmc.models.shapes import hf_config, random_model  # noqa: E402
from hsmc.models.size import weight_bytes  # noqa: E402
from hsmc.ops.backend import HeadLayout, Rope, TorchBackend  # noqa: E402
from hsmc.ops.batch import ForwardBatch, padded_columns  # noqa: E402
from hsmc.ops.kv_cache import KVCache  # noqa: E402
from hsmc.ops.paged_attention import paged_attention, plan_attention  # noqa: E402
from hsmc.ops.triton_backend import TritonBackend  # noqa: E402

results: dict = {}
summary: list[str] = []
TINY_PROMPTS = [[5, 9, 13], [7] * 11, [40, 41, 42, 43, 44, 45], [3, 4]]  # of the tiny-model sections


def say(line: str) -> None:
    print(line, flush=True)
    summary.append(line)


def ragged_batch(rng: random.Random, rows: int, tokens: int, max_context: int, slots: int) -> ForwardBatch:
    start = torch.tensor([rng.randint(0, max_context - tokens) for _ in range(rows)], device="cuda")
    start[0] = max_context - tokens  # one row at the longest context
    num_new = torch.tensor([rng.randint(1, tokens) for _ in range(rows)], device="cuda")
    num_new[0] = tokens
    table = torch.randperm(slots, device="cuda")[: (rows + 1) * (max_context + 1)].view(rows + 1, -1)
    row_ids = torch.arange(rows, device="cuda")
    cols = padded_columns(start, num_new, tokens)
    valid = torch.arange(tokens, device="cuda")[None] < num_new[:, None]
    write = torch.where(valid, table[row_ids[:, None], cols], slots)
    zeros = torch.zeros(rows, tokens, dtype=torch.int64, device="cuda")
    return ForwardBatch(row_ids, table, zeros, cols, write, start, num_new, int((start + num_new).max()))


def check_kernels() -> None:
    say("== kernels: compiled Triton vs torch reference on the GPU ==")
    rng = random.Random(0)
    worst = {}
    cases = [  # rows, tokens, max context, heads, kv heads
        (1, 1, 8192, 32, 8),
        (4, 1, 3000, 64, 8),
        (16, 1, 700, 32, 8),
        (16, 9, 2048, 64, 8),
        (3, 5, 8192, 32, 8),
        (2, 128, 1024, 32, 8),
        (5, 17, 200, 16, 8),
        (2, 1, 1, 32, 8),
    ]
    for dtype, tol in ((torch.bfloat16, 2e-2), (torch.float16, 3e-3), (torch.float32, 2e-5)):
        for rows, tokens, context, heads, kv_heads in cases:
            slots = (rows + 1) * (context + 1) + 7
            batch = ragged_batch(rng, rows, tokens, context, slots)
            cache = KVCache(1, slots, kv_heads, 128, dtype, "cuda")
            cache.data.normal_()
            q = torch.randn(rows, tokens, heads, 128, dtype=dtype, device="cuda")
            plan = plan_attention(rows, tokens, batch.max_context, heads, kv_heads, 132)
            out = paged_attention(
                q, cache.keys(0), cache.values(0), batch.table, batch.rows, batch.start, batch.num_new, plan
            )
            meta = TorchBackend().prepare(batch, Rope(torch.ones(64, device="cuda"), 1.0), dtype)
            ref = TorchBackend().attend(0, q, cache, batch, meta).view(q.shape)
            err = max((out[i, :n] - ref[i, :n]).abs().max().item() for i, n in enumerate(batch.num_new.tolist()))
            key = f"attention {str(dtype)[6:]} R{rows} T{tokens} L{context} H{heads}/{kv_heads} splits{plan.splits}"
            worst[key] = err
            assert err <= tol, f"{key}: max error {err}"
    say(f"paged attention: {len(worst)} cases, worst max|err| per dtype: " + ", ".join(
        f"{d} {max(v for k, v in worst.items() if d in k):.2e}" for d in ("bfloat16", "float16", "float32")
    ))  # fmt: skip
    # fused kernels in bf16: distance in units of bf16 resolution
    from hsmc.ops import fused as fused_kernels
    from hsmc.ops.backend import rms_norm_reference

    tb, ref = TritonBackend(), TorchBackend()
    x = torch.randn(64, 5120, device="cuda", dtype=torch.bfloat16) * 4
    res = torch.randn_like(x)
    w = (1 + 0.1 * torch.randn(5120, device="cuda")).to(torch.bfloat16)

    def ulps(a, b):
        return ((a.float() - b.float()).abs() / (b.float().abs().clamp_min(1) * 2**-7)).max().item()

    silu_ref = torch.nn.functional.silu(x) * res
    fused = {
        "rms_norm": ulps(fused_kernels.rms_norm(x, w, 1e-6), rms_norm_reference(x, w, 1e-6)),
        "silu_mul": ulps(fused_kernels.silu_mul(torch.cat([x, res], -1)), silu_ref),
    }
    # one-row Linears (norm / SiLU prologue, residual epilogue) on the 8B's shapes vs the reference backend
    linears = {}
    for name, (n, k, step) in {"qkv+norm": (6144, 4096, "norm"), "o+residual": (4096, 4096, "residual"),
                               "down+silu+residual": (4096, 12288, "silu")}.items():  # fmt: skip
        lin = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        norm = torch.nn.Module()
        norm.weight, norm.eps = w[:k] if k <= 5120 else w.repeat(3)[:k], 1e-6
        x1 = torch.randn(1, 1, 2 * k if step == "silu" else k, device="cuda", dtype=torch.bfloat16)
        r1 = torch.randn(1, 1, n, device="cuda", dtype=torch.bfloat16)
        pair = [
            b.norm_linear(x1, norm, lin) if step == "norm" else
            b.linear(x1, lin, r1) if step == "residual" else b.silu_linear(x1, lin, r1)
            for b in (tb, ref)
        ]  # fmt: skip
        linears[name] = ((pair[0].float() - pair[1].float()).norm() / pair[1].float().norm()).item()
    say("one-row fused Linears vs reference backend (bf16, rel. error): "
        + ", ".join(f"{k} {v:.1e}" for k, v in linears.items()))  # fmt: skip
    results["kernels_linears"] = linears
    heads = HeadLayout(32, 8, 128)
    qkv = torch.randn(4, 9, 48 * 128, device="cuda", dtype=torch.bfloat16)
    batch = ragged_batch(rng, 4, 9, 300, 2000)
    rope = Rope(1.0 / (1e6 ** (torch.arange(0, 128, 2, device="cuda").float() / 128)), 1.0)
    norms = (w[:128], w[128:256], 1e-6)
    outs = []
    for backend in (tb, ref):
        cache = KVCache(1, 2000, 8, 128, torch.bfloat16, "cuda")
        outs.append(
            (
                backend.qkv_to_cache(0, qkv, heads, norms, cache, batch, backend.prepare(batch, rope, torch.bfloat16)),
                cache.data,
            )
        )
    valid = torch.arange(9, device="cuda")[None] < batch.num_new[:, None]
    fused["qk_norm+rope (q)"] = ulps(outs[0][0][valid], outs[1][0][valid])
    fused["kv write"] = ulps(outs[0][1][:, :, :2000], outs[1][1][:, :, :2000])
    say("fused kernels, bf16, max distance in bf16 ulps: " + ", ".join(f"{k} {v:.1f}" for k, v in fused.items()))
    # decode attention bandwidth at a long context (batch 16 x 4k context, 8 KV heads, d=128, bf16)
    slots = 17 * 4097 + 7
    batch = ragged_batch(rng, 16, 1, 4096, slots)
    batch = ForwardBatch(**{**batch.__dict__, "start": torch.full_like(batch.start, 4095)})
    cache = KVCache(1, slots, 8, 128, torch.bfloat16, "cuda")
    cache.data.normal_()
    q = torch.randn(16, 1, 32, 128, dtype=torch.bfloat16, device="cuda")
    plan = plan_attention(16, 1, 4096, 32, 8, 132)
    import triton

    ms = triton.testing.do_bench(
        lambda: paged_attention(
            q, cache.keys(0), cache.values(0), batch.table, batch.rows, batch.start, batch.num_new, plan
        ),
        return_mode="median",
    )
    kv_bytes = 16 * 4096 * 8 * 128 * 2 * 2
    say(f"decode attention 16 rows x 4096 keys: {ms * 1e3:.1f} us, {kv_bytes / ms / 1e9:.2f} TB/s of K/V read")
    results["kernels"] = {"attention": worst, "fused_ulps": fused, "decode_attention_us": ms * 1e3}


def check_vocab() -> None:
    """The one-pass vocabulary kernels (`hsmc.ops.vocab`) compiled: Gumbel-max draws against the exact law over a
    full Qwen3 vocabulary (chi-square on the 20 likeliest tokens and the rest), their log-probabilities, float64
    log-sum-exps against torch, and the time of a draw / of the weights' log-sum-exps against the torch route."""
    import triton
    from scipy.stats import chisquare

    from hsmc.ops.backend import TorchBackend
    from hsmc.ops.counter_hash import combine
    from hsmc.ops.vocab import gumbel_max, logsumexp_rows

    say("== vocabulary kernels: Gumbel-max draws and float64 log-sum-exps over 151,936 logits ==")
    vocab, n, temperature = 151936, 200_000, 0.8
    gen = torch.Generator("cuda").manual_seed(0)
    row = (torch.randn(vocab, device="cuda", generator=gen) * 2.5).to(torch.bfloat16)

    def per_row(value: float, rows: int, dtype=torch.float32) -> torch.Tensor:
        return torch.full((rows,), value, dtype=dtype, device="cuda")

    keys = combine(torch.tensor(11, device="cuda"), torch.arange(n, device="cuda"))
    tokens, logprobs = gumbel_max(row.expand(n, -1), per_row(1 / temperature, n), per_row(-math.inf, n), keys)
    probs = torch.softmax(row.double() / temperature, -1)
    top = probs.topk(20).indices
    bins = torch.full((vocab,), 20, dtype=torch.int64, device="cuda")
    bins[top] = torch.arange(20, device="cuda")
    observed = torch.bincount(bins[tokens], minlength=21).double().cpu()
    expected = torch.cat([probs[top], (1 - probs[top].sum())[None]]).cpu() * n
    pvalue = chisquare(observed.numpy(), expected.numpy()).pvalue
    lp_err = (logprobs.double() - torch.log_softmax(row.double() / temperature, -1)[tokens]).abs().max().item()
    logits = torch.randn(72, vocab, device="cuda", generator=gen).to(torch.bfloat16) * 3
    lse = logsumexp_rows(logits, per_row(1 / 0.7, 72, torch.float64), per_row(-math.inf, 72))
    lse_err = (lse - torch.logsumexp(logits.double() / 0.7, -1)).abs().max().item()
    eight = logits[:8]
    one, none, eight_keys = per_row(1.0, 8), per_row(-math.inf, 8), keys[:8]
    draw_ms = triton.testing.do_bench(lambda: gumbel_max(eight, one, none, eight_keys), return_mode="median")
    reference = TorchBackend()
    on_cpu = eight.cpu(), one.cpu(), none.cpu(), eight_keys.cpu()
    torch_ms = triton.testing.do_bench(lambda: reference.gumbel_max(*on_cpu), return_mode="median")
    ones64, none72 = per_row(1.0, 72, torch.float64), per_row(-math.inf, 72)
    lse_ms = triton.testing.do_bench(lambda: logsumexp_rows(logits, ones64, none72), return_mode="median")
    lse_torch_ms = triton.testing.do_bench(lambda: torch.logsumexp(logits.double(), -1), return_mode="median")
    say(f"{n} draws at T={temperature}: chi-square p = {pvalue:.3f} (20 likeliest tokens + rest); max |log-prob "
        f"error| {lp_err:.1e}; float64 log-sum-exp of 72 rows: max |error| {lse_err:.1e}")  # fmt: skip
    say(f"one draw for 8 rows: kernels {draw_ms * 1e3:.1f} us, torch route (CPU) {torch_ms * 1e3:.1f} us; logsumexp of "
        f"72 rows: kernels {lse_ms * 1e3:.1f} us, torch float64 {lse_torch_ms * 1e3:.1f} us (eager)")  # fmt: skip
    results["vocab"] = {
        "chi2_p": pvalue,
        "logprob_err": lp_err,
        "lse_err": lse_err,
        "draw_us": draw_ms * 1e3,
        "draw_torch_us": torch_ms * 1e3,
        "lse_us": lse_ms * 1e3,
        "lse_torch_us": lse_torch_ms * 1e3,
    }
    assert pvalue > 1e-4 and lp_err < 1e-4 and lse_err < 1e-9


def tiny_stack_configs(root: Path) -> dict[str, dict]:
    draft = make_tiny_model("llama", root / "draft", seed=1)
    target = make_tiny_model("llama", root / "target", seed=2)
    llama = TINY_CONFIGS["llama"]
    sizes = (llama["hidden_size"], llama["num_attention_heads"], llama["num_key_value_heads"], 16, 96)
    head, _ = published_layout(root / "head", dtype=torch.float32, sizes=(*sizes, 101, 40), scale=0.3)
    return {
        "rejection": {
            "levels": [
                {"kind": "model", "model": str(draft), "temperature": 0.0},
                {"kind": "rejection", "model": str(target), "num_draft_tokens": 4},
            ]
        },
        "eagle3": {
            "levels": [
                {"kind": "eagle3", "model": str(head), "temperature": 0.0},
                {"kind": "rejection", "model": str(target), "num_draft_tokens": 3},
            ]
        },
    }


def synced_generate(decoder: HierarchicalDecoder, prompts, new_tokens: int, **generation) -> tuple[list, list[str]]:
    """generate() under torch.cuda.set_sync_debug_mode: returns the results and every place that synced."""
    import warnings

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results = decoder.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True, **generation)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = sorted({f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)})
    return results, syncs


def greedy_cuda_vs_cpu(config: dict, prompts, new_tokens: int, **generation) -> tuple[bool, int, list[str]]:
    """Greedy tokens on CUDA (Triton + graphs; after a warm-up, under the sync debug mode) vs the CPU oracle."""
    engine = {**config.get("engine", {}), "kv_capacity_tokens": 2048}
    cpu = HierarchicalDecoder.from_config({**config, "engine": engine})
    want = [r.token_ids for r in cpu.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True, **generation)]
    cuda = HierarchicalDecoder.from_config({**config, "engine": {**engine, "device": "cuda"}})
    cuda.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True, **generation)  # warm-up: captures graphs
    results, syncs = synced_generate(cuda, prompts, new_tokens, **generation)
    same = sum(r.token_ids == b for r, b in zip(results, want))
    return same == len(want), same, syncs


def check_tiny() -> None:
    from transformers import AutoModelForCausalLM

    say("== tiny models: CUDA (Triton + CUDA graphs) vs CPU ==")
    torch.backends.cuda.matmul.allow_tf32 = False
    root = Path(tempfile.mkdtemp())
    out = {}
    rng = random.Random(1)
    for arch in ("llama", "qwen2", "qwen3"):
        path = make_tiny_model(arch, root / arch)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        model = load_model(str(path), device="cuda").model
        tables = BlockTables(SlotAllocator(2048, "cuda"), 16, 256)
        runner = ModelRunner(model, tables, TritonBackend(), model.config.num_layers, cuda_graphs=True)
        contexts = [[rng.randrange(80) for _ in range(n)] for n in (5, 1, 12, 3, 8, 2, 17, 6, 9)]
        new = [[rng.randrange(80) for _ in range(k)] for k in range(1, 10)]
        err = 0.0
        with torch.inference_mode():
            for batch_tokens, check in ((contexts, False), (new, True)):
                rows = torch.arange(9, device="cuda")
                width = max(len(x) for x in batch_tokens)
                tokens = torch.zeros(9, width, dtype=torch.int64)
                for i, x in enumerate(batch_tokens):
                    tokens[i, : len(x)] = torch.tensor(x)
                counts = torch.tensor([len(x) for x in batch_tokens], device="cuda")
                batch = runner.new_tokens(rows, tokens.cuda(), counts, 64)
                logits, _ = runner.forward(batch)
                if check:
                    for i in range(9):
                        ref = hf(torch.tensor([contexts[i] + new[i]])).logits[0, len(contexts[i]) :]
                        err = max(err, (logits[i, : len(new[i])].float().cpu() - ref).abs().max().item())
        prompts = contexts[:4]
        same, n, syncs = greedy_cuda_vs_cpu({"levels": [{"model": str(path)}]}, prompts, 24)
        out[arch] = {"logit_err": err, "greedy_equal": same, "syncs": syncs}
        say(f"tiny {arch}: ragged batch through graphs max|logit diff| vs transformers-CPU {err:.2e}; "
            f"greedy CUDA == CPU {n}/{len(prompts)}; synchronizing ops in generate(): {syncs or 'none'}")  # fmt: skip
    stacks = tiny_stack_configs(root)
    stacks["rejection-two-at-a-time"] = {**stacks["rejection"], "engine": {"max_batch_rows": 2}}  # the others join
    for name, cfg in stacks.items():
        prompts = TINY_PROMPTS
        same, n, syncs = greedy_cuda_vs_cpu(cfg, prompts, 24)
        out[name] = {"greedy_equal": same, "syncs": syncs}
        say(f"tiny stack {name}: greedy CUDA == CPU {n}/{len(prompts)}; synchronizing ops: {syncs or 'none'}")
    results["tiny"] = out


def smc_stacks(root: Path, temperature: float) -> dict[str, dict]:
    """The SMC stacks of tests/test_host_reads.py on tiny models with a tokenizer (for the stop string)."""
    vocab = [chr(ord("a") + i % 26) * (1 + i // 26) for i in range(TINY_CONFIGS["llama"]["vocab_size"])]
    models = {name: make_tiny_model("llama", root / name, seed=seed) for name, seed in (("d", 1), ("m", 3), ("t", 2))}
    for folder in models.values():
        save_tokenizer(folder, vocab)
    llama = TINY_CONFIGS["llama"]
    sizes = (llama["hidden_size"], llama["num_attention_heads"], llama["num_key_value_heads"], 16, 96, 101, 101)
    models["h"], _ = published_layout(root / "head", dtype=torch.float32, sizes=sizes, scale=0.3)
    stacks = {
        "model-smc": "model:d",
        "model-rejection-smc": "model:d rejection:m",
        "model-rejection-rejection-smc": "model:d rejection:m rejection:d",
        "eagle3-rejection-smc": "eagle3:h rejection:d",
        "eagle3-smc": "eagle3:h",
    }
    smc = {"kind": "smc", "model": str(models["t"]), "temperature": temperature, "particles": 4, "block_size": 3}
    configs = {}
    for name, spec in stacks.items():
        levels = []
        for part in spec.split():
            kind, model = part.split(":")
            levels.append({"kind": kind, "model": str(models[model]), "temperature": temperature})
            if kind == "rejection":
                levels[-1]["num_draft_tokens"] = 2
        configs[name] = {"levels": [*levels, {**smc, "ess_threshold": 0.9}]}
    return configs


def smc_cases(root: Path) -> tuple[dict[str, dict], dict[str, dict], list[tuple[str, str, dict, dict]]]:
    """The tiny SMC stacks at T = 1e-4 and at T = 1, and the cases to run them in: (label, stack, generation
    options, engine options) for each stack, two stacks with rows for two of the four requests at a time (the
    others join as rows free: continuous batching) and two with different N per request."""
    greedy, sampled = smc_stacks(root / "greedy", 1e-4), smc_stacks(root / "sampled", 1.0)
    cases = [(name, name, {}, {}) for name in greedy]
    two = {"max_batch_rows": 8}
    cases += [(f"{name}-two-at-a-time", name, {}, two) for name in ("model-smc", "eagle3-rejection-smc")]
    mixed = {"particles": [1, 4, 2, 3]}  # groups of the largest N's rows
    cases += [(f"{name}-mixed-n", name, mixed, {}) for name in ("model-smc", "model-rejection-smc")]
    return greedy, sampled, cases


def check_smc_sync() -> None:
    say("== tiny SMC stacks on CUDA: synchronizing calls, near-greedy CUDA == CPU, same seed twice ==")
    torch.backends.cuda.matmul.allow_tf32 = False
    prompts = TINY_PROMPTS
    out = {}
    greedy, sampled, cases = smc_cases(Path(tempfile.mkdtemp()))
    cases.append(("model-smc-stop-string", "model-smc", {"stop": ["bb"]}, {}))
    for label, name, generation, rows in cases:
        try:
            same, n, syncs = greedy_cuda_vs_cpu({**greedy[name], "engine": rows}, prompts, 24, **generation)
            engine = {"device": "cuda", "kv_capacity_tokens": 2048, **rows}
            cuda = HierarchicalDecoder.from_config({**sampled[name], "engine": engine})
            runs = [cuda.generate(prompts, max_new_tokens=24, ignore_eos=True, seed=7, **generation) for _ in range(2)]
            repeat = [r.token_ids for r in runs[0]] == [r.token_ids for r in runs[1]]
            out[label] = {"near_greedy_equal": same, "syncs": syncs, "same_seed_equal": repeat}
            say(f"smc {label}: T=1e-4 CUDA == CPU {n}/{len(prompts)}; synchronizing ops: {syncs or 'none'}; "
                f"T=1 same seed twice equal: {repeat}")  # fmt: skip
        except Exception as e:  # one stack failing must not hide the others
            out[label] = {"error": f"{type(e).__name__}: {e}"}
            say(f"!! smc {label} failed: {type(e).__name__}: {e}")
    results["smcsync"] = out


@contextmanager
def real_shape_case(section: str, label: str, out: dict) -> Iterator[None]:
    """One real-shape case of a section: timed, its failure (e.g. out of memory) recorded in `out` and printed
    without stopping the other cases, its GPU memory handed back afterwards."""
    began = time.perf_counter()
    try:
        yield
    except Exception as e:
        import traceback

        traceback.print_exc()
        out[label] = {"error": f"{type(e).__name__}: {e}"}
        say(f"!! {section} {label} failed: {type(e).__name__}: {e}")
    say(f"({label}: {time.perf_counter() - began:.0f} s)")
    gc.collect()
    torch.cuda.empty_cache()


def smc_target() -> str:
    """The SMC target of the bench configs on this GPU: the 32B shape where it fits beside the 8B, else the 14B."""
    memory = torch.cuda.get_device_properties(0).total_memory / 1e9
    return "random:qwen3-32b" if memory >= 120 else "random:qwen3-14b"


def check_smc_bench() -> None:
    say("== SMC stacks on the real shapes, random bf16 weights: hsmc bench --config ==")
    target = smc_target()
    say(f"target {target} (the 32B's 65.5 GB + the 8B's 16.4 GB need ≥ 120 GB)")
    out = {}
    for name in ("smc_8b_32b", "hierarchical_8b_32b", "selfdraft_8b_32b"):
        with real_shape_case("smcbench", name, out):
            path = ROOT / "configs" / "bench" / f"{name}.yaml"
            top = len(load_config(path).levels) - 1
            config = load_config(path, [f"levels.{top}.model={target}"])
            rows, table = run_bench([], config, [1, 4, 16], 64, 64, "bfloat16", False, {}, name)
            say(table)
            out[name] = json.loads(to_json(rows))
    results["smcbench"] = {"target": target, **out}


def graphed_rejection(decoder: HierarchicalDecoder):
    """The stack's rejection level whose rounds are captured (`Graphs`)."""
    return next(lv for lv in decoder.stack.levels if getattr(lv, "rounds", None) is not None)


def check_rounds() -> None:
    """Rejection rounds captured as one CUDA graph each: the tiny stacks whose rejection level is graphed give
    the CPU's tokens near-greedily, with no synchronizing call after the warm-up, and at T = 1 the tokens of the
    same stack with eager rounds (same seed). The real shapes run first (graphed vs eager rounds in the same run),
    in a process that has run nothing else."""
    say("== graphed rejection rounds: CUDA == CPU, graphed == eager rounds, synchronizing calls, speed ==")
    out = {}
    bandwidth = copy_bandwidth(torch.device("cuda"), 2.0)
    say(f"device: {torch.cuda.get_device_name(0)}; copy bandwidth {bandwidth / 1e12:.3f} TB/s")
    for name in ("eagle3_8b",):
        with real_shape_case("rounds", name, out):
            config = load_config(ROOT / "configs" / "bench" / f"{name}.yaml")
            decoder = HierarchicalDecoder(config_for_bench(config, [1, 4, 16], 64, 128))
            graphed = bench_stack(f"{name} graphed", decoder, [1, 4, 16], 64, 128, bandwidth)
            graphed_rejection(decoder).rounds = None
            eager = bench_stack(f"{name} eager", decoder, [1, 4, 16], 64, 128, bandwidth)
            say(format_stack_table(graphed + eager))
            for g, e in zip(graphed, eager):
                say(f"{name}, {g.batch} requests: graphed rounds {g.tok_s_total:.1f} tok/s, eager rounds (same run) "
                    f"{e.tok_s_total:.1f}: {g.tok_s_total / e.tok_s_total:.2f}x; step {g.step_ms:.2f} vs "
                    f"{e.step_ms:.2f} ms, bound {g.bound_step_ms:.2f} ms")  # fmt: skip
            out[name] = {"graphed": json.loads(to_json(graphed)), "eager": json.loads(to_json(eager))}
            del decoder
    torch.backends.cuda.matmul.allow_tf32 = False
    root = Path(tempfile.mkdtemp())
    prompts = TINY_PROMPTS
    engine = {"device": "cuda", "kv_capacity_tokens": 2048}
    for temperature in (1e-4, 1.0):
        folder = root / f"t{temperature}"
        stacks = smc_stacks(folder, temperature)  # writes the tiny models d, m, t and the head
        cases = {n: stacks[n] for n in ("model-rejection-smc", "eagle3-rejection-smc", "model-rejection-rejection-smc")}
        for name, drafter, verifier in (("model-rejection", "model:d", "t"), ("eagle3-rejection", "eagle3:head", "d")):
            kind, model = drafter.split(":")
            cases[name] = {
                "levels": [
                    {"kind": kind, "model": str(folder / model), "temperature": temperature},
                    {"kind": "rejection", "model": str(folder / verifier), "temperature": temperature,
                     "num_draft_tokens": 3},
                ]
            }  # fmt: skip
        for name, cfg in cases.items():
            label = f"{name} T={temperature:g}"
            try:
                graphed = HierarchicalDecoder.from_config({**cfg, "engine": engine})
                eager = HierarchicalDecoder.from_config({**cfg, "engine": engine})
                graphed_rejection(eager).rounds = None
                for decoder in (graphed, eager):  # rounds alone, as under an SMC level with stop strings
                    if hasattr(decoder.stack.top, "cycle_graphs"):
                        decoder.stack.top.cycle_graphs = None
                graphed.generate(prompts, max_new_tokens=24, ignore_eos=True, seed=7)  # warm-up: captures the rounds
                runs, syncs = synced_generate(graphed, prompts, 24, seed=7)
                tokens = [r.token_ids for r in runs]
                eager_tokens = eager.generate(prompts, max_new_tokens=24, ignore_eos=True, seed=7)
                row = {
                    "replays": graphed_rejection(graphed).rounds.replays,
                    "syncs": syncs,
                    "graphed_equals_eager": tokens == [r.token_ids for r in eager_tokens],
                }
                line = (f"rounds {label}: {row['replays']} replayed rounds; synchronizing ops: {syncs or 'none'}; "
                        f"graphed == eager rounds (same seed): {row['graphed_equals_eager']}")  # fmt: skip
                if temperature < 1:
                    cpu = HierarchicalDecoder.from_config({**cfg, "engine": {"kv_capacity_tokens": 2048}})
                    want = [r.token_ids for r in cpu.generate(prompts, max_new_tokens=24, ignore_eos=True, seed=7)]
                    row["cuda_equals_cpu"] = sum(a == b for a, b in zip(tokens, want))
                    line += f"; CUDA == CPU {row['cuda_equals_cpu']}/{len(prompts)}"
                out[label] = row
                say(line)
            except Exception as e:  # one stack failing must not hide the others
                out[label] = {"error": f"{type(e).__name__}: {e}"}
                say(f"!! rounds {label} failed: {type(e).__name__}: {e}")
    results["rounds"] = out


def pool_bytes(pool) -> int:
    """Bytes of the CUDA caching allocator's segments in a graph memory pool."""
    segments = torch.cuda.memory_snapshot()
    return sum(seg["total_size"] for seg in segments if tuple(seg["segment_pool_id"]) == tuple(pool))


def check_cycles() -> None:
    """SMC cycles captured as one CUDA graph each: speed on the real shapes (graphed vs eager cycles in the same
    run, in a process that has run nothing else) and the cycle graphs' memory; then the tiny SMC stacks give the
    CPU's tokens near-greedily with no synchronizing call after the warm-up, and at T = 1 the tokens of the same
    stack with eager cycles (same seed)."""
    from hsmc.engine.kv_sizing import LOGIT_COPIES

    say("== graphed SMC cycles: speed, memory, CUDA == CPU, graphed == eager cycles, synchronizing calls ==")
    out = {}
    target = smc_target()
    bandwidth = copy_bandwidth(torch.device("cuda"), 2.0)
    say(f"device: {torch.cuda.get_device_name(0)}; copy bandwidth {bandwidth / 1e12:.3f} TB/s; smc target {target}")
    cases = [("smc_8b_32b", [], [1, 4, 16]), ("smc_8b_32b", ["particles=6", "block_size=16"], [1]),
             ("hierarchical_8b_32b", [], [1, 4, 16])]  # fmt: skip
    for name, smc_overrides, batches in cases:
        label = " ".join([name, *smc_overrides])
        with real_shape_case("cycles", label, out):
            path = ROOT / "configs" / "bench" / f"{name}.yaml"
            top = len(load_config(path).levels) - 1
            overrides = [f"levels.{top}.model={target}", *(f"levels.{top}.{o}" for o in smc_overrides)]
            decoder = HierarchicalDecoder(config_for_bench(load_config(path, overrides), batches, 64, 128))
            rows = bench_stack(label, decoder, batches, 64, 128, bandwidth)
            say(format_stack_table(rows))
            for r in rows:
                say(f"{label}, {r.batch} requests: graphed cycles {r.tok_s_request:.1f} tok/s/req, eager cycles (same "
                    f"run) {r.eager_cycles_tok_s_request:.1f}: {r.tok_s_request / r.eager_cycles_tok_s_request:.2f}x; "
                    f"cycle {r.step_ms:.2f} ms, bound {r.bound_step_ms:.2f} ms ({r.of_bound:.2f}x); "
                    f"{r.levels[-1].get('graphed_cycles', 0)} replays in the eager-cycle run (expect 0)")  # fmt: skip
            smc = decoder.stack.top
            rows_max, width = max(batches) * smc.params.particles, smc.params.block_size + 1
            vocab = smc.state.runner.module.config.vocab_size
            estimate = LOGIT_COPIES * rows_max * width * vocab * 4
            used = pool_bytes(smc.cycle_graphs.scope.pool)  # the stack's one pool: forwards', rounds', cycles'
            graphs, smc.cycle_graphs = smc.cycle_graphs, None  # the eager cycles' peak, for the same requests
            ids = [[7] * 64 for _ in range(max(batches))]
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            decoder.generate(ids, max_new_tokens=48, ignore_eos=True)
            eager_peak = torch.cuda.max_memory_allocated() - base
            smc.cycle_graphs = graphs
            say(f"{label}: cycle graphs' pool {used / 2**30:.2f} GiB for {len(graphs.captured)} captured shapes; "
                f"eager cycles' peak above the resident memory {eager_peak / 2**30:.2f} GiB; the KV reserve's "
                f"logits term for {rows_max} rows x {width}: {estimate / 2**30:.2f} GiB")  # fmt: skip
            out[label] = {"rows": json.loads(to_json(rows)), "pool_bytes": used, "eager_peak": eager_peak,
                          "reserve_term": estimate}  # fmt: skip
            del decoder, smc, graphs
    torch.backends.cuda.matmul.allow_tf32 = False
    prompts = TINY_PROMPTS
    greedy, sampled, cases = smc_cases(Path(tempfile.mkdtemp()))
    for label, name, generation, rows in cases:
        try:
            engine = {"device": "cuda", "kv_capacity_tokens": 2048, **rows}
            near = HierarchicalDecoder.from_config({**greedy[name], "engine": engine})
            near.generate(prompts, max_new_tokens=24, ignore_eos=True, seed=7, **generation)  # warm-up: captures
            runs, syncs = synced_generate(near, prompts, 24, seed=7, **generation)
            cpu = HierarchicalDecoder.from_config({**greedy[name], "engine": {"kv_capacity_tokens": 2048, **rows}})
            want = cpu.generate(prompts, max_new_tokens=24, ignore_eos=True, seed=7, **generation)
            same = sum(a.token_ids == b.token_ids for a, b in zip(runs, want))
            graphed = HierarchicalDecoder.from_config({**sampled[name], "engine": engine})
            eager = HierarchicalDecoder.from_config({**sampled[name], "engine": engine})
            eager.stack.top.cycle_graphs = None
            tokens = {}
            for tag, decoder in (("graphed", graphed), ("eager", eager)):
                decoder.generate(prompts, max_new_tokens=24, ignore_eos=True, seed=7, **generation)
                tokens[tag] = [r.token_ids for r in decoder.generate(prompts, max_new_tokens=24, ignore_eos=True,
                                                                      seed=7, **generation)]  # fmt: skip
            row = {"replays": near.stack.top.cycle_graphs.replays, "syncs": syncs, "cuda_equals_cpu": same,
                   "sampled_replays": graphed.stack.top.cycle_graphs.replays,
                   "graphed_equals_eager": tokens["graphed"] == tokens["eager"]}  # fmt: skip
            out[label] = row
            say(f"cycles {label}: T=1e-4 {row['replays']} replayed cycles, synchronizing ops: {syncs or 'none'}, "
                f"CUDA == CPU {same}/{len(prompts)}; T=1 {row['sampled_replays']} replayed cycles, graphed == eager "
                f"cycles (same seed): {row['graphed_equals_eager']}")  # fmt: skip
        except Exception as e:  # one stack failing must not hide the others
            import traceback

            traceback.print_exc()
            out[label] = {"error": f"{type(e).__name__}: {e}"}
            say(f"!! cycles {label} failed: {type(e).__name__}: {e}")
    results["cycles"] = out


def check_smollm2(gguf: Path) -> None:
    say("== SmolLM2-135M-Instruct: greedy CUDA == CPU ==")
    from hsmc.models.demo import demo_model_folder

    folder = demo_model_folder("smollm2-135m-instruct", gguf.parent)
    prompts = [
        "What is the capital of France? Answer in one sentence.",
        "Write a Python function that returns the factorial of n.",
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?",
    ]
    from hsmc.models.tokenizer import encode_prompt, load_tokenizer

    tok = load_tokenizer(folder)
    ids = [encode_prompt(tok, p, True) for p in prompts]
    out = {}
    for name, cfg in {
        "model": {"levels": [{"model": str(folder)}]},
        "truncated-draft rejection": {
            "levels": [
                {"kind": "model", "model": str(folder), "num_layers": 12},
                {"kind": "rejection", "model": str(folder), "num_draft_tokens": 4},
            ]
        },
        "eagle3 rejection": {
            "levels": [
                {"kind": "eagle3", "model": str(ROOT / "assets/eagle3-smollm2-135m-instruct"), "dtype": "float32"},
                {"kind": "rejection", "model": str(folder), "num_draft_tokens": 4},
            ]
        },
    }.items():
        same, n, syncs = greedy_cuda_vs_cpu(cfg, ids, 48)
        out[name] = {"greedy_equal": same, "syncs": syncs}
        say(f"smollm2 {name}: greedy CUDA == CPU {n}/{len(ids)} (48 tokens); synchronizing ops: {syncs or 'none'}")
    results["smollm2"] = out


def check_bench() -> None:
    say("== decode speed: hsmc vs transformers eager vs roofline ==")
    engine = {"max_batch_rows": 16, "kv_capacity_tokens": 8192}
    began = time.perf_counter()
    rows, table = run_bench(["qwen3-8b"], None, [1, 4, 16], 128, 256, "bfloat16", True, engine)
    rows32, table32 = run_bench(["qwen3-32b"], None, [1], 128, 256, "bfloat16", True, engine)
    say(table)
    say(table32)
    results["bench"] = [r.__dict__ | {"of_roofline": r.of_roofline} for r in rows + rows32]
    say(f"(bench wall time {time.perf_counter() - began:.0f} s)")


def check_sync_8b() -> None:
    say("== Qwen3-8B shape, batch 4: synchronizing ops in generate() after a warm-up ==")
    from hsmc.bench import shape_case

    decoder, _, _ = shape_case("qwen3-8b", "bfloat16", torch.device("cuda"), {"kv_capacity_tokens": 4096})
    prompts = torch.randint(0, 150000, (4, 128)).tolist()
    decoder.generate(prompts, max_new_tokens=8, ignore_eos=True)
    _, syncs = synced_generate(decoder, prompts, 64)
    say(f"qwen3-8b batch 4, 64 new tokens: synchronizing ops: {syncs or 'none'}")
    results["sync_8b"] = syncs


def check_attention_variants() -> None:
    """Decode-shaped attention (one query token per row; G = 4 as the 8B, 8 as the 32B) over launch variants."""
    cases = [(32, 8, 1100), (32, 8, 4400), (32, 16, 300), (32, 16, 2000), (32, 16, 4096), (32, 32, 2000)]
    cases += [(64, 8, 1100), (64, 16, 4096)]
    results["attention_variants"] = time_attention_plans("decode", 1, cases, warps=(2, 4, 8))


def check_verify_attention() -> None:
    """Verify-shaped attention (9 query tokens per row) over launch variants."""
    cases = [(64, rows, context) for rows in (8, 16) for context in (268, 1100, 2200, 4400)]
    cases += [(32, 8, context) for context in (268, 1100, 4400)]
    results["verify_attention"] = time_attention_plans("verify", 9, cases, warps=(4, 8))


def time_attention_plans(label: str, tokens: int, cases: list[tuple[int, int, int]], warps: tuple[int, ...]) -> dict:
    """For each (query heads, rows, keys) with 8 KV heads of 128 (bf16): the planner's plan against every split x
    key block x warps, each timed as 16 calls replayed in one graph (a Python launch would take longer than the
    kernel), checked against the planner's output."""
    from hsmc.ops.paged_attention import AttentionPlan

    say(f"== {label} attention variants (us per call; d 128, bf16, {tokens} query tokens per row) ==")
    rng = random.Random(6)
    out = {}
    for heads, rows, context in cases:
        slots = (rows + 1) * (context + 10) + 7
        batch = ragged_batch(rng, rows, tokens, context, slots)
        start, num_new = torch.full_like(batch.start, context - tokens), torch.full_like(batch.num_new, tokens)
        batch = ForwardBatch(**{**batch.__dict__, "start": start, "num_new": num_new})
        cache = KVCache(1, slots, 8, 128, torch.bfloat16, "cuda")
        cache.data.normal_()
        q = torch.randn(rows, tokens, heads, 128, dtype=torch.bfloat16, device="cuda")
        keys, values = cache.keys(0), cache.values(0)

        def attend(plan, batch=batch, q=q, keys=keys, values=values):
            return paged_attention(q, keys, values, batch.table, batch.rows, batch.start, batch.num_new, plan)

        def calls(plan):
            return lambda: [attend(plan) for _ in range(16)]

        current = plan_attention(rows, tokens, context, heads, 8, 132)
        reference = attend(current)
        timings = {}
        for splits in (1, 2, 4, 8, 16):
            for block_n in (32, 64, 128):
                for w in warps:
                    plan = AttentionPlan(current.block_t, current.block_m, splits, block_n, w)
                    if not torch.allclose(attend(plan).float(), reference.float(), atol=2e-2, rtol=2e-2):
                        say(f"  H{heads} R{rows} L{context} {plan}: differs from the planner's output, skipped")
                        continue
                    timings[(splits, block_n, w)] = graph_ms(calls(plan)) / 16 * 1e3
        now = graph_ms(calls(current)) / 16 * 1e3
        ranked = sorted(timings, key=timings.get)[:4]
        kv_gbs = rows * context * 8 * 128 * 2 * 2 / (now * 1e-6) / 1e9
        say(f"G{heads // 8} R{rows:<3} L{context:<5} planner t{current.block_t} {current.splits}x{current.block_n}/"
            f"{current.num_warps}w {now:6.1f} us ({kv_gbs:.0f} GB/s of K/V); best (splits, block_n, warps): "
            + ", ".join(f"{k} {timings[k]:.1f}" for k in ranked))  # fmt: skip
        out[f"G{heads // 8} R{rows} L{context}"] = {str(k): v for k, v in timings.items()} | {"planner": now}
    return out


def check_capture_time() -> None:
    cfg = DecoderConfig.from_hf(hf_config("qwen3-8b"))
    model = random_model(cfg, torch.bfloat16, "cuda")
    tables = BlockTables(SlotAllocator(8192, "cuda"), 16, 8192)
    runner = ModelRunner(model, tables, TritonBackend(), cfg.num_layers, cuda_graphs=True)
    torch.cuda.synchronize()
    began = time.perf_counter()
    with torch.inference_mode():
        row = torch.zeros(1, dtype=torch.int64, device="cuda")  # a decode step's first use captures every bucket
        runner.forward(runner.new_tokens(row, row[:, None], row + 1, 1), True)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - began
    n = len(runner.graphs.captured)
    say(f"capture of the 8B decode graphs ({n} buckets: rows {runner.graphs.row_buckets} x context "
        f"{runner.scope.context_buckets}), kernels compiled: {seconds:.1f} s")  # fmt: skip
    results["capture_seconds"] = seconds


def check_verify() -> None:
    say("== verify forward: 16 rows x 9 tokens, Qwen3-32B shape ==")
    import triton

    cfg = DecoderConfig.from_hf(hf_config("qwen3-32b"))
    model = random_model(cfg, torch.bfloat16, "cuda")
    bw = copy_bandwidth(torch.device("cuda"))
    tables = BlockTables(SlotAllocator(16 * 1024, "cuda"), 16, 1024)
    runner = ModelRunner(model, tables, TritonBackend(), cfg.num_layers, cuda_graphs=True)
    rows = torch.arange(16, device="cuda")
    with torch.inference_mode():
        prompt = torch.randint(0, cfg.vocab_size, (16, 128), device="cuda")
        runner.forward(runner.new_tokens(rows, prompt, torch.full((16,), 128, device="cuda"), 128), last_only=True)
        tokens = torch.randint(0, cfg.vocab_size, (16, 9), device="cuda")
        nine = torch.full((16,), 9, device="cuda")

        def verify():  # the same 9 tokens again and again: each verify is rolled back after it
            runner.forward(runner.new_tokens(rows, tokens, nine, 137))
            tables.rollback(rows, nine, 9)

        verify()
        ms = triton.testing.do_bench(verify, return_mode="median")
    read_ms = weight_bytes(model) / bw * 1e3
    say(f"verify 16x9 on 32B: {ms:.2f} ms; weights once at {bw / 1e12:.2f} TB/s: {read_ms:.2f} ms; "
        f"ratio {ms / read_ms:.2f}x")  # fmt: skip
    results["verify"] = {"ms": ms, "weight_read_ms": read_ms, "ratio": ms / read_ms}
    w = model.model.layers[0].mlp.gate_up_proj.weight  # [51200, 5120]
    sweep = {}
    for m in (16, 64, 128, 144, 160, 256):
        x = torch.randn(m, w.shape[1], device="cuda", dtype=torch.bfloat16)
        gemm_ms = triton.testing.do_bench(lambda x=x: torch.nn.functional.linear(x, w), return_mode="median")
        sweep[m] = (w.numel() * 2 / gemm_ms / 1e9, 2 * m * w.numel() / gemm_ms / 1e9)
    say("32B gate_up GEMM by rows M (TB/s of weight read, TFLOP/s): "
        + ", ".join(f"M={m} {tb:.2f}/{tf:.0f}" for m, (tb, tf) in sweep.items()))  # fmt: skip
    results["verify"]["gate_up_sweep"] = sweep


def check_prefill() -> None:
    say("== chunked prefill: 8 prompts of 512..4096 tokens, Qwen3-8B shape (random bf16) ==")
    from hsmc.levels.base import SequenceState

    cfg = DecoderConfig.from_hf(hf_config("qwen3-8b"))
    model = random_model(cfg, torch.bfloat16, "cuda")
    rows_n, length = 8, 4096
    tables = BlockTables(SlotAllocator(rows_n * length + 64, "cuda"), rows_n, length + 64)
    runner = ModelRunner(model, tables, TritonBackend(), cfg.num_layers, cuda_graphs=True)
    rows = torch.arange(rows_n, device="cuda")
    lengths = [length - 512 * i for i in range(rows_n)]  # ragged: rows end in different chunks
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    out = {}
    last = {}
    for budget in (2**40, 16384, 8192, 4096):
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
            last[budget] = step.logits[:, 0].float()
            state.release(rows)
        ms = sorted(times)[1] * 1e3
        label = "one forward" if budget == 2**40 else f"chunks of {budget} tokens"
        tok_s = sum(lengths) / ms * 1e3
        say(f"prefill {sum(lengths)} tokens ({rows_n} rows, {min(lengths)}..{max(lengths)}) in {label}: {ms:.1f} ms "
            f"({tok_s:.0f} tok/s), peak activations {peak / 2**30:.2f} GiB")  # fmt: skip
        out[label] = {"ms": ms, "tok_s": tok_s, "peak_gib": peak / 2**30}
    whole = last[2**40]
    for budget, logits in last.items():
        if budget != 2**40:
            same = (logits.argmax(-1) == whole.argmax(-1)).float().mean().item()
            diff = (logits - whole).abs().max().item()
            say(f"chunks of {budget} vs one forward: last-token argmax equal {same:.0%}, max |logit diff| {diff:.3g}")
            out[f"agree_{budget}"] = {"argmax_equal": same, "max_abs_diff": diff}
    del model, runner, tables
    gc.collect()
    torch.cuda.empty_cache()
    # chunks narrow enough to replay decode/verify graphs (a replay's outputs are reused buffers)
    stacks = tiny_stack_configs(Path(tempfile.mkdtemp()))
    rng = random.Random(3)
    prompts = [[rng.randrange(80) for _ in range(n)] for n in (1, 9, 40, 23)]
    for name, config in stacks.items():
        config = {**config, "engine": {"prefill_chunk_tokens": 24}}  # 4 rows: 6 tokens per row and chunk
        same, n, syncs = greedy_cuda_vs_cpu(config, prompts, 16)
        say(f"tiny {name}, prompts of 1..40 tokens in chunks of 24 tokens: CUDA greedy == CPU {n}/{len(prompts)}, "
            f"syncs {syncs or 'none'}")  # fmt: skip
        out[f"tiny_{name}"] = {"greedy_equal": same, "syncs": syncs}
    results["prefill"] = out


def check_verify_gemm_routes() -> None:
    say("== cuBLAS routes for verify-sized GEMMs, Qwen3-32B matrices (4 copies each, chained in a graph) ==")
    import torch.nn.functional as F

    bw = copy_bandwidth(torch.device("cuda"))
    shapes = {"qkv": (10240, 5120), "o": (5120, 8192), "gate_up": (51200, 5120), "down": (5120, 25600)}
    out = {}
    for name, (n, k) in shapes.items():
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        wts = [w.t().contiguous().t() for w in ws]  # the same matrix stored [K, N] (column-major view)
        read_ms = 4 * n * k * 2 / bw * 1e3
        for m in (72, 144):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            routes = {
                "x@W^T": lambda: [F.linear(x, w) for w in ws],
                "(W@x^T)^T": lambda: [torch.mm(w, x.t()).t().contiguous() for w in ws],
                "x@Wt (W stored KxN)": lambda: [torch.mm(x, w) for w in [t.t() for t in wts]],
                "pad 192": lambda: [F.linear(F.pad(x, (0, 0, 0, 192 - m)), w)[:m] for w in ws],
                "pad 256": lambda: [F.linear(F.pad(x, (0, 0, 0, 256 - m)), w)[:m] for w in ws],
            }
            for label, fn in routes.items():
                try:
                    ms = graph_ms(fn)
                except Exception as e:  # a route cuBLAS refuses must not hide the others
                    say(f"  {name} M={m} {label}: failed ({type(e).__name__}: {e})")
                    continue
                say(f"  {name} [{n}x{k}] M={m} {label}: {ms / 4 * 1e3:.0f} us per matrix, "
                    f"{read_ms / ms:.0%} of copy")  # fmt: skip
                out[f"{name}/{m}/{label}"] = {"ms": ms / 4, "of_copy": read_ms / ms}
    results["verify_gemm_routes"] = out


def one_row_runner_8b(slots: int) -> tuple[ModelRunner, BlockTables, torch.Tensor, torch.Tensor]:
    """A Qwen3-8B-shaped runner (random bf16, Triton, CUDA graphs) for one row; (runner, tables, rows, one)."""
    cfg = DecoderConfig.from_hf(hf_config("qwen3-8b"))
    tables = BlockTables(SlotAllocator(slots, "cuda"), 1, slots)
    model = random_model(cfg, torch.bfloat16, "cuda")
    runner = ModelRunner(model, tables, TritonBackend(), cfg.num_layers, cuda_graphs=True)
    rows = torch.zeros(1, dtype=torch.int64, device="cuda")
    return runner, tables, rows, torch.ones(1, dtype=torch.int64, device="cuda")


def profile_forward(
    shape: str, rows_n: int, width: int, context: int, head: bool = False
) -> tuple[float, float, dict[str, tuple[float, int]]]:
    """GPU time of one forward (graph replay) of `rows_n` rows x `width` new tokens after `context` tokens of the
    random bf16 `shape` (or of a random EAGLE3 head for it), by kernel (torch.profiler): (weight read ms, wall ms
    per forward, {kernel: (us per forward, launches)})."""
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
    rows = torch.arange(rows_n, device="cuda")
    full = torch.full((rows_n,), width, device="cuda")
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
        prefill = runner.new_tokens(rows, prompt, torch.full((rows_n,), context, device="cuda"), context)
        runner.forward(prefill, True, **inputs(context))
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        import triton

        wall_ms = triton.testing.do_bench(step, return_mode="median")
    kernels = {e.key: (e.device_time_total / 5, e.count // 5) for e in prof.key_averages() if e.device_time_total > 0}
    read_ms = weight_bytes(model) / copy_bandwidth(torch.device("cuda")) * 1e3
    return read_ms, wall_ms, kernels


def say_profile(label: str, read_ms: float, wall_ms: float, kernels: dict[str, tuple[float, int]]) -> None:
    """Under PDL a kernel's time includes its wait for the one before it: the sums overlap."""
    total = sum(us for us, _ in kernels.values())
    say(f"{label}: {wall_ms:.3f} ms per forward (kernels summed {total / 1e3:.2f} ms); weight read {read_ms:.2f} ms")
    for name, (us, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:14]:
        say(f"  {name[:60]:<60}{us / 1e3:8.3f} ms {us / total:6.1%}  x{n}")


def check_profile() -> None:
    say("== one 8B decode step, by kernel (torch.profiler, graph replay) ==")
    read_ms, wall_ms, kernels = profile_forward("qwen3-8b", 1, 1, 259)
    say_profile("8B, 1 row", read_ms, wall_ms, kernels)
    results["profile_us"] = kernels


def check_profile_smc() -> None:
    """With PDL a kernel's profiled time includes its wait for the previous one; without it each kernel's own
    time shows (and the difference in wall time is what PDL saves)."""
    from hsmc.ops import pdl

    say("== the forwards of an SMC cycle (N=8, K=8), by kernel (torch.profiler, graph replay), with / without PDL ==")
    for use_pdl in (True, False):
        pdl.pdl_supported.cache_clear()
        if not use_pdl:
            pdl.pdl_supported = functools.cache(lambda device: False)
        for shape, rows_n, width, head, label in (
            ("qwen3-8b", 8, 1, False, "8B proposal step, 8 x 1"),
            ("qwen3-32b", 8, 9, False, "32B verify, 8 x 9"),
            ("qwen3-8b", 6, 1, True, "EAGLE3 head of the 8B, draft step 6 x 1"),
        ):
            read_ms, wall_ms, kernels = profile_forward(shape, rows_n, width, 259, head)
            say_profile(f"{label}, PDL {'on' if use_pdl else 'off'}", read_ms, wall_ms, kernels)
            results[f"profile_smc_{label}_pdl_{use_pdl}"] = {"wall_ms": wall_ms, "kernels": kernels}
            gc.collect()
            torch.cuda.empty_cache()


KERNEL_KINDS = (("_few_row", "few-row Linears"), ("nvjet", "cuBLAS GEMMs"), ("splitKreduce", "cuBLAS GEMMs"),
                ("_attention", "attention"), ("_combine", "attention"), ("_rms_norm", "RMSNorms"),
                ("_qkv_rope", "q/k norm + RoPE + KV"), ("_silu", "SiLU·mul"), ("_sum_splits", "split-K sums"),
                ("_decode_linear", "one-row Linears"), ("_lse_", "vocab reductions"),
                ("_gumbel_", "vocab reductions"))  # fmt: skip


def check_cycle_kernels() -> None:
    """Where a graphed SMC cycle's GPU time goes: one 128-token request through configs/bench/smc_8b_32b.yaml
    (N=8 K=8 and N=6 K=16) profiled after two warm-ups, kernels by kind per cycle (under PDL a kernel's time
    includes its wait), the kernels outside the forwards (the levels' bookkeeping and the SMC math), and the
    GPU's idle time. Kernels inside graphs are traced one by one (CUPTI)."""
    from torch.profiler import ProfilerActivity, profile

    say("== kernels per graphed SMC cycle, one request (torch.profiler) ==")
    path = ROOT / "configs" / "bench" / "smc_8b_32b.yaml"
    out = {}
    for overrides in ([], ["levels.1.particles=6", "levels.1.block_size=16"]):
        label = " ".join(["smc_8b_32b", *overrides])
        with real_shape_case("cyclekernels", label, out):
            config = load_config(path, [f"levels.1.model={smc_target()}", *overrides])
            decoder = HierarchicalDecoder(config_for_bench(config, [1], 64, 128))
            ids = [list(range(100, 164))]
            for _ in range(2):
                decoder.generate(ids, max_new_tokens=128, ignore_eos=True)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                decoder.generate(ids, max_new_tokens=128, ignore_eos=True)
                torch.cuda.synchronize()
            cycles = max(decoder.stack.top.cycle_graphs.replays, 1)
            kernels = sorted(
                (e.time_range.start, e.time_range.end, e.name)
                for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0
            )
            by_kind: dict[str, list[float]] = {}
            for start, end, name in kernels:
                kind = next((k for key, k in KERNEL_KINDS if key in name), "outside the forwards")
                by_kind.setdefault(kind, [0.0, 0])
                by_kind[kind][0] += (end - start) / cycles
                by_kind[kind][1] += 1 / cycles
            busy, reach = 0.0, kernels[0][0]
            for start, end, _ in kernels:
                busy += max(0.0, end - max(start, reach))
                reach = max(reach, end)
            window = reach - kernels[0][0]
            idle = window - busy
            say(f"{label}: {cycles} graphed cycles; GPU idle {idle / 1e3:.2f} ms of {window / 1e3:.1f} ms (the "
                f"prefill's launches included); per cycle, kernel time summed:")  # fmt: skip
            for kind, (us, n) in sorted(by_kind.items(), key=lambda kv: -kv[1][0]):
                say(f"  {kind:<24}{us / 1e3:8.3f} ms {n:8.1f} kernels")
            out[label] = {"cycles": cycles, "idle_us": idle, "by_kind": by_kind}
            del decoder
    results["cyclekernels"] = out


# -- FP8 weights, the streaming loader and auto-sized KV (issue 12) ---------------------------------------
# Each section runs on the GPU at the real shapes; `--device cpu --tiny` runs the same code on small shapes
# (Triton through its interpreter) so the suite can check the sections themselves.

DEVICE = torch.device("cuda")
TINY = False
H100_BYTES = 79 * 2**30  # what an H100 80 GB leaves free to a process (fp8stack emulates it on larger GPUs)
TINY_SHAPE = dict(hidden_size=256, intermediate_size=384, num_hidden_layers=6, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=128, vocab_size=1024)  # fmt: skip


def shape_config(shape: str):
    """The transformers config of a named shape (`--tiny`: the same family at sizes the CPU runs quickly)."""
    from transformers import AutoConfig

    from hsmc.models.shapes import SHAPES

    return AutoConfig.for_model(**{**SHAPES[shape], **(TINY_SHAPE if TINY else {})})


def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def bench_ms(fn, reps: int = 20) -> float:
    """Median wall time of fn in ms (triton's do_bench on the GPU)."""
    if DEVICE.type == "cuda":
        import triton

        return triton.testing.do_bench(fn, return_mode="median")
    fn()
    times = []
    for _ in range(3 if TINY else reps):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return sorted(times)[len(times) // 2] * 1e3


def fp8_matmul(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor, plan=None) -> torch.Tensor:
    """The FP8 Linear's matmul as a model runs it on the GPU (Triton up to 256 rows, else dequantize + cuBLAS),
    forced through the Triton kernel for <= 256 rows on the CPU too (interpreted)."""
    from hsmc.ops.fp8_gemm import fp8_gemm
    from hsmc.ops.fp8_linear import QWEN_BLOCK, TRITON_MAX_ROWS, dequantize_fp8

    if x.shape[0] <= TRITON_MAX_ROWS:
        return fp8_gemm(x, w, s, QWEN_BLOCK, plan)
    return torch.nn.functional.linear(x, dequantize_fp8(w, s, QWEN_BLOCK, x.dtype))


def check_fp8_gemm() -> None:
    say("== fp8gemm: Triton weight-only FP8 GEMM vs the dequantized reference; time vs bf16 cuBLAS ==")
    from hsmc.ops.fp8_gemm import Fp8GemmPlan, plan_fp8_gemm
    from hsmc.ops.fp8_linear import QWEN_BLOCK, dequantize_fp8, quantize_fp8

    dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32  # the interpreter has no bf16 dot
    matrices = {  # (N, K) of each Linear
        "32b.qkv": (10240, 5120), "32b.o": (5120, 8192), "32b.gate_up": (51200, 5120), "32b.down": (5120, 25600),
        "8b.qkv": (6144, 4096), "8b.o": (4096, 4096), "8b.gate_up": (24576, 4096), "8b.down": (4096, 12288),
    }  # fmt: skip
    rows = (1, 2, 4, 8, 16, 32, 64, 144, 256, 512)
    if TINY:
        matrices, rows = {"tiny.ragged": (200, 328), "tiny.square": (256, 256)}, (1, 5, 300)
    out, worst = {}, 0.0
    g = torch.Generator(DEVICE).manual_seed(0)
    for name, (n, k) in matrices.items():
        dense = torch.randn(n, k, device=DEVICE, generator=g, dtype=dtype) * 0.02
        w, s = quantize_fp8(dense, QWEN_BLOCK)
        ref_w = dequantize_fp8(w, s, QWEN_BLOCK, torch.float32)
        bf16_w = ref_w.to(dtype)  # the same weights, dense: cuBLAS's time for the same product
        for m in rows:
            x = torch.randn(m, k, device=DEVICE, generator=g, dtype=dtype)
            ref = x.float() @ ref_w.T
            err = ((fp8_matmul(x, w, s).float() - ref).abs().max() / ref.abs().max()).item()
            worst = max(worst, err)
            ms = bench_ms(lambda x=x: fp8_matmul(x, w, s))
            dense_ms = bench_ms(lambda x=x: torch.nn.functional.linear(x, bf16_w))
            tb_s = (w.numel() + s.numel() * 4) / ms / 1e9
            out[f"{name} M={m}"] = {"rel_err": err, "ms": ms, "bf16_ms": dense_ms, "fp8_TB_s": tb_s}
        say(f"{name} [{n}x{k}]: " + ", ".join(
            f"M={m} {out[f'{name} M={m}']['ms'] * 1e3:.0f}us ({out[f'{name} M={m}']['fp8_TB_s']:.2f} TB/s, "
            f"{out[f'{name} M={m}']['bf16_ms'] / out[f'{name} M={m}']['ms']:.2f}x bf16)" for m in rows))  # fmt: skip
    say(f"fp8gemm: worst max|out - ref| / max|ref| over all shapes and rows: {worst:.2e} "
        f"({'ok' if worst < 1e-2 else 'TOO LARGE'}: fp32 accumulation, bf16 inputs)")  # fmt: skip
    # launch settings around the default plan at 16 rows (an SMC proposal of 16 particles)
    sweep = {}
    for name in ("32b.gate_up", "32b.qkv") if not TINY else ("tiny.square",):
        n, k = matrices[name]
        w, s = quantize_fp8(torch.randn(n, k, device=DEVICE, generator=g, dtype=dtype) * 0.02, QWEN_BLOCK)
        x = torch.randn(16, k, device=DEVICE, generator=g, dtype=dtype)
        default = plan_fp8_gemm(16, n, k, QWEN_BLOCK[1], DEVICE)
        plans = [default] + [
            Fp8GemmPlan(16, bn, 128, split, warps, 3)
            for bn in (32, 64, 128) for split in (1, 2, 4) for warps in (4, 8)
        ][: 2 if TINY else None]  # fmt: skip
        timed_plans = sorted(((bench_ms(lambda p=p: fp8_matmul(x, w, s, p)), p) for p in plans), key=lambda t: t[0])
        bytes_read = w.numel() + s.numel() * 4
        best_ms, best = timed_plans[0]
        default_ms = next(t for t, p in timed_plans if p == default)
        sweep[name] = {"default": str(default), "default_TB_s": bytes_read / default_ms / 1e9,
                       "best": str(best), "best_TB_s": bytes_read / best_ms / 1e9}  # fmt: skip
        say(f"M=16 {name}: default {default} {bytes_read / default_ms / 1e9:.2f} TB/s; "
            f"best {best} {bytes_read / best_ms / 1e9:.2f} TB/s")  # fmt: skip
    # many rows (SMC verify of 48 rows x 17 tokens = 816, prefill chunks): the Triton kernel vs dequantize + cuBLAS,
    # to place the switch (hsmc.ops.fp8_linear.TRITON_MAX_ROWS)
    from hsmc.ops.fp8_gemm import fp8_gemm

    name = "32b.gate_up" if not TINY else "tiny.square"
    n, k = matrices[name]
    w, s = quantize_fp8(torch.randn(n, k, device=DEVICE, generator=g, dtype=dtype) * 0.02, QWEN_BLOCK)
    crossover = {}
    for m in (144, 256, 512, 816, 2048) if not TINY else (300,):
        x = torch.randn(m, k, device=DEVICE, generator=g, dtype=dtype)
        triton_ms = bench_ms(lambda x=x: fp8_gemm(x, w, s, QWEN_BLOCK))
        dequant_ms = bench_ms(lambda x=x: torch.nn.functional.linear(x, dequantize_fp8(w, s, QWEN_BLOCK, x.dtype)))
        crossover[m] = {"triton_ms": triton_ms, "dequant_cublas_ms": dequant_ms}
    say(f"{name} by rows, Triton kernel vs dequantize + cuBLAS: " + ", ".join(
        f"M={m} {c['triton_ms']:.3f}/{c['dequant_cublas_ms']:.3f} ms" for m, c in crossover.items()))  # fmt: skip
    results["fp8gemm"] = {"shapes": out, "worst_rel_err": worst, "m16_sweep": sweep, "crossover": crossover}


def check_fp8_decode() -> None:
    say("== fp8decode: batch-1 decode, FP8 vs bf16 weights in the same run (qwen3-8b, qwen3-32b shapes) ==")
    if DEVICE.type != "cuda":
        say("fp8decode: needs CUDA (hsmc bench measures GPU decode): skipped")
        return
    engine = {"max_batch_rows": 1, "kv_capacity_tokens": 1024}
    rows, table = run_bench(["qwen3-8b", "qwen3-32b"], None, [1], 128, 256, "fp8", False, engine)
    say(table)
    for r in rows:
        if r.vs_bf16:
            say(f"{r.name}: {r.hsmc_tok_s:.1f} tok/s = {r.of_roofline:.1%} of the FP8 roofline "
                f"({r.roofline_tok_s:.1f} tok/s, weights incl. scales), {r.vs_bf16:.2f}x bf16")  # fmt: skip
    results["fp8decode"] = [r.__dict__ | {"of_roofline": r.of_roofline} for r in rows]


def dense_twin(fp8_model, dtype: torch.dtype):
    """The same model with every FP8 Linear replaced by a dense Linear holding its dequantized weight."""
    from torch import nn

    from hsmc.ops.fp8_linear import Fp8Linear

    for name, module in list(fp8_model.named_modules()):
        if isinstance(module, Fp8Linear):
            dense = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
            dense.weight = nn.Parameter(module.dequantized(dtype), requires_grad=False)
            dense.bias = module.bias
            owner, _, child = name.rpartition(".")
            fp8_model.get_submodule(owner).add_module(child, dense)
    return fp8_model


def check_fp8_logits() -> None:
    from hsmc.ops.fp8_linear import Fp8Linear

    say(
        "== fp8logits: qwen3-8b shape, FP8 (weight-only, and with FP8 activations) and bf16 models vs the fp32 model "
        "on the same dequantized weights =="
    )
    dtype = torch.bfloat16
    cfg = DecoderConfig.from_hf(shape_config("qwen3-8b"))
    backend = TritonBackend() if DEVICE.type == "cuda" else TorchBackend()
    logits = {}
    for kind in ("fp8", "fp8 activations", "bf16", "fp32"):  # fp32: the exact math the others round
        model = random_model(cfg, dtype, DEVICE, seed=5, fp8=True)
        if kind == "fp8 activations":  # `engine.fp8_activations`: the prompt's forward quantizes activations
            for module in model.modules():
                if isinstance(module, Fp8Linear):
                    module.dynamic_activations = True
        elif kind == "bf16":
            model = dense_twin(model, dtype)
        elif kind == "fp32":  # every tensor in fp32 (the RoPE frequencies already are)
            model = dense_twin(model, torch.float32).float()
        tables = BlockTables(SlotAllocator(4096, DEVICE), 4, 1024)
        runner = ModelRunner(model, tables, backend, cfg.num_layers, cuda_graphs=DEVICE.type == "cuda")
        rows = torch.arange(4, device=DEVICE)
        prompt = torch.randint(0, cfg.vocab_size, (4, 64), generator=torch.Generator().manual_seed(1)).to(DEVICE)
        with torch.inference_mode():
            first, _ = runner.forward(runner.new_tokens(rows, prompt, torch.full((4,), 64, device=DEVICE), 64), True)
            steps, tokens = [first[:, -1].float()], first[:, -1].argmax(-1)
            for i in range(16):  # greedy decode: both models fed the FP8 model's tokens (same contexts)
                feed = tokens if kind == "fp8" else logits["fp8_tokens"][i]
                out, _ = runner.forward(runner.new_tokens(rows, feed[:, None], torch.ones(4, dtype=torch.int64,
                                        device=DEVICE), 65 + i), True)  # fmt: skip
                steps.append(out[:, -1].float())
                tokens = out[:, -1].argmax(-1)
                if kind == "fp8":
                    logits.setdefault("fp8_tokens", []).append(feed)
        logits[kind] = torch.stack(steps)
        del runner, model
        gc.collect()
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()
    exact = logits["fp32"]
    scale = exact.std().item()
    results["fp8logits"] = {"logit_std": scale}
    for kind in ("fp8", "fp8 activations", "bf16"):
        diff = (logits[kind] - exact).abs()
        agree = (logits[kind].argmax(-1) == exact.argmax(-1)).float().mean().item()
        say(f"fp8logits: {kind} vs fp32: max|diff| {diff.max().item():.3e}, mean|diff| {diff.mean().item():.3e} "
            f"(logit std {scale:.3e}); argmax agreement {agree:.1%} over 17 positions x 4 rows")  # fmt: skip
        results["fp8logits"][kind] = {"max_diff": diff.max().item(), "mean_diff": diff.mean().item(),
                                      "argmax_agreement": agree}  # fmt: skip
    for kind in ("fp8", "fp8 activations"):
        ratio = results["fp8logits"][kind]["mean_diff"] / results["fp8logits"]["bf16"]["mean_diff"]
        say(f"fp8logits: the {kind} path's mean error is {ratio:.2f}x bf16's own rounding error on the same weights")
        results["fp8logits"][f"{kind} over bf16 error"] = ratio


def check_fp8_stack() -> None:
    say("== fp8stack: the headline stack's shapes (FP8 32B + FP8 8B + EAGLE3 head), KV auto, a few SMC cycles ==")
    import hsmc.levels.stack

    real_free = hsmc.levels.stack.free_memory
    total = torch.cuda.get_device_properties(DEVICE).total_memory if DEVICE.type == "cuda" else 0
    emulated = ""
    if total > H100_BYTES + 2**30:  # a larger GPU: hold the run to an H100's 80 GB
        torch.cuda.set_per_process_memory_fraction(H100_BYTES / total)
        hsmc.levels.stack.free_memory = lambda device: min(
            real_free(device), H100_BYTES - torch.cuda.memory_reserved(device)
        )
        emulated = f" (an H100's {H100_BYTES / 2**30:.0f} GiB emulated on this {total / 2**30:.0f} GiB GPU)"
    try:
        run_fp8_stack(emulated)
    finally:
        hsmc.levels.stack.free_memory = real_free
        if emulated:
            torch.cuda.set_per_process_memory_fraction(1.0)


def run_fp8_stack(emulated: str) -> None:
    from hsmc.models.loading import LoadedModel

    if DEVICE.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    began = time.perf_counter()
    big = random_model(DecoderConfig.from_hf(shape_config("qwen3-32b")), torch.bfloat16, DEVICE, seed=1, fp8=True)
    small_cfg = shape_config("qwen3-8b")
    small = random_model(DecoderConfig.from_hf(small_cfg), torch.bfloat16, DEVICE, seed=2, fp8=True)
    root = Path(tempfile.mkdtemp())
    c = small_cfg
    sizes = (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size,
             c.vocab_size, 32000 if not TINY else 512)  # fmt: skip
    head, _ = published_layout(root / "head", dtype=torch.bfloat16, sizes=sizes, scale=0.02)
    head_config = json.loads((head / "config.json").read_text())  # a published head's context is its verifier's
    head_config["max_position_embeddings"] = c.max_position_embeddings
    (head / "config.json").write_text(json.dumps(head_config))
    loaded = f"{time.perf_counter() - began:.0f} s"
    weights = weight_bytes(big) + weight_bytes(small)
    config = {
        "levels": [
            {"kind": "eagle3", "model": str(head), "dtype": "bfloat16", "temperature": 0.6},
            {"kind": "rejection", "model": "8b", "dtype": "bfloat16", "temperature": 0.6, "num_draft_tokens": 4},
            {"kind": "smc", "model": "32b", "dtype": "bfloat16", "temperature": 0.6, "particles": 6, "block_size": 16},
        ],
        "engine": {"device": str(DEVICE), "max_batch_rows": 48,  # as configs/qwen3_32b.yaml
                   "kv_capacity_tokens": "auto" if DEVICE.type == "cuda" else 4096},
        "generation": {"max_new_tokens": 64 if not TINY else 20, "ignore_eos": True},
    }  # fmt: skip
    models = {"32b": LoadedModel(big, None, "32b"), "8b": LoadedModel(small, None, "8b")}
    prompts = torch.randint(0, 1000, (2, 128 if not TINY else 8), generator=torch.Generator().manual_seed(0)).tolist()
    for dynamic in (False, True):  # weight-only FP8, then FP8 activations on the multi-row forwards
        config["engine"]["fp8_activations"] = dynamic
        decoder = HierarchicalDecoder(load_config(config), models)
        decoder.generate(prompts, max_new_tokens=8)  # warm-up: kernels compiled, graphs captured
        sync()
        began = time.perf_counter()
        out = decoder.generate(prompts)
        sync()
        seconds = time.perf_counter() - began
        tokens = sum(len(r.token_ids) for r in out)
        peak = torch.cuda.max_memory_allocated() if DEVICE.type == "cuda" else 0
        runners = decoder.stack.runners
        kv = sum(r.cache.data.numel() * r.cache.data.element_size() for r in runners)
        levels = out[0].stats["levels"]
        tag = "fp8 activations" if dynamic else "weight-only fp8"
        say(f"fp8stack{emulated} [{tag}]: weights {weights / 1e9:.1f} GB (built in {loaded}), KV auto: "
            f"{decoder.stack.capacity} slots ({kv / 2**30:.1f} GiB); 2 prompts x 6 particles: {tokens} tokens in "
            f"{seconds:.2f} s = {tokens / seconds:.1f} tok/s (after a warm-up); torch.cuda.max_memory_allocated "
            f"{peak / 2**30:.1f} GiB, of it {(peak - weights - kv) / 2**30:.1f} GiB neither weights nor KV "
            f"({'fits an H100 80 GB: ok' if peak < H100_BYTES else 'OVER an H100 80 GB'}); per level forward ms: "
            + ", ".join(f"{lv['kind']} {lv['forward_ms']:.2f}" for lv in levels))  # fmt: skip
        results.setdefault("fp8stack", {})[tag] = {
            "weights_bytes": weights, "kv_slots": decoder.stack.capacity, "kv_bytes": kv, "tokens": tokens,
            "seconds": seconds, "max_memory_allocated": peak, "emulated_h100": bool(emulated), "levels": levels,
        }  # fmt: skip
        del decoder, out, runners
        gc.collect()
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()


RSS_MEASURE = """
import json, sys, torch
from hsmc.models.loading import load_model

def status(field):
    line = next(x for x in open("/proc/self/status") if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024

device = sys.argv[2]
torch.zeros(1, device=device)  # the CUDA context and the imports before the measurement
load_model(sys.argv[1], "bfloat16", device, num_layers=1)
torch.cuda.empty_cache() if device == "cuda" else None
with open("/proc/self/clear_refs", "w") as f:  # restart VmHWM from here
    f.write("5")
base = status("VmRSS")
began = __import__("time").perf_counter()
model = load_model(sys.argv[1], "bfloat16", device).model
seconds = __import__("time").perf_counter() - began
resident = sum(p.numel() * p.element_size() for p in model.parameters()) if device == "cpu" else 0
print(json.dumps({"peak": status("VmHWM") - base, "resident_model": resident, "seconds": seconds}))
"""


def write_fp8_checkpoint(folder: Path, shape: str, layers: int, shard_bytes: int) -> list[int]:
    """A random checkpoint of `shape` (its first `layers` layers) in Qwen's FP8 layout, written shard by shard;
    returns the shard sizes."""
    from safetensors.torch import save_file

    hf = shape_config(shape)
    hf.num_hidden_layers = min(layers, hf.num_hidden_layers)
    model = random_model(DecoderConfig.from_hf(hf), torch.bfloat16, DEVICE, seed=3, fp8=True)
    folder.mkdir(parents=True)
    quant = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic", "fmt": "e4m3"}
    (folder / "config.json").write_text(json.dumps({**hf.to_dict(), "quantization_config": quant}))
    state = model.state_dict()
    del model
    names, shard, sizes, weight_map = sorted(state), {}, [], {}

    def flush() -> None:
        name = f"model-{len(sizes) + 1:05d}.safetensors"
        save_file(shard, folder / name)
        weight_map.update(dict.fromkeys(shard, name))
        sizes.append((folder / name).stat().st_size)
        shard.clear()

    for key in names:
        shard[key] = state.pop(key).contiguous().cpu()
        if sum(t.numel() * t.element_size() for t in shard.values()) >= shard_bytes:
            flush()
    if shard:
        flush()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return sizes


def check_fp8_rss() -> None:
    say("== fp8rss: peak CPU RSS while streaming a 32B-shape FP8 checkpoint onto the device ==")
    import shutil
    import subprocess

    root = Path(tempfile.mkdtemp())
    free = shutil.disk_usage(root).free
    # all 64 layers are ~34 GB; with less disk, the first 32 (~18 GB): the shards are the same size either way
    layers = 64 if free > 40e9 or TINY else 32 if free > 22e9 else 0
    if not layers:
        say(f"fp8rss: {free / 1e9:.0f} GB free on {root}, at least 22 GB needed: skipped")
        return
    try:
        began = time.perf_counter()
        sizes = write_fp8_checkpoint(root / "ckpt", "qwen3-32b", layers, 4 * 10**9 if not TINY else 10**6)
        written = time.perf_counter() - began
        gc.collect()
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()
        env = {**os.environ, "PYTHONPATH": str(ROOT), "MALLOC_MMAP_THRESHOLD_": "65536"}
        run = subprocess.run([sys.executable, "-c", RSS_MEASURE, str(root / "ckpt"), DEVICE.type],
                             capture_output=True, text=True, env=env)  # fmt: skip
        if run.returncode:
            raise RuntimeError(f"the loading process failed: {run.stderr.strip().splitlines()[-1:]}")
        rss = json.loads(run.stdout.strip().splitlines()[-1])
        transient = rss["peak"] - rss["resident_model"]
        largest = max(sizes)
        say(f"fp8rss: {layers} layers, {len(sizes)} shards, {sum(sizes) / 1e9:.1f} GB (largest "
            f"{largest / 1e9:.2f} GB), written in {written:.0f} s; loaded onto {DEVICE.type} in "
            f"{rss['seconds']:.0f} s with peak RSS growth {transient / 1e9:.2f} GB = "
            f"{transient / largest:.2f}x the largest shard "
            f"({'<= 1.5x: ok' if transient <= 1.5 * largest else 'OVER 1.5x'})")  # fmt: skip
        results["fp8rss"] = {"shards": sizes, "peak_rss_growth": transient, "ratio": transient / largest,
                             "load_seconds": rss["seconds"], "write_seconds": written}  # fmt: skip
    finally:
        shutil.rmtree(root, ignore_errors=True)


# -- Fused decode Linears chained with PDL ------------------------------------------------------------------


def layer_linears_of(shape: str, fp8: bool, layers: int | None = None) -> tuple[list[dict], dict]:
    """Random weights of a shape's decoder-layer Linears ([N, K] bf16, or FP8 + block scales) and norms."""
    from hsmc.ops.fp8_linear import QWEN_BLOCK, quantize_fp8

    cfg = shape_config(shape)
    h, i = cfg.hidden_size, cfg.intermediate_size
    hd = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    dims = {"qkv": ((cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * hd, h),
            "o": (h, cfg.num_attention_heads * hd), "gate_up": (2 * i, h), "down": (h, i)}  # fmt: skip
    out = []
    for _ in range(layers or cfg.num_hidden_layers):
        layer = {}
        for name, (n, k) in dims.items():
            w = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) / k**0.5
            layer[name] = quantize_fp8(w, QWEN_BLOCK) if fp8 else (w, None)
        layer["norm1"] = torch.rand(h, device=DEVICE, dtype=torch.bfloat16) + 0.5
        layer["norm2"] = torch.rand(h, device=DEVICE, dtype=torch.bfloat16) + 0.5
        out.append(layer)
    return out, dims


def linear_chain(layers: list[dict], dims: dict, x: torch.Tensor, fused: bool) -> torch.Tensor:
    """A decoder's Linears at one row without attention (o reads the first columns of qkv): separate norm /
    SiLU / add kernels around cuBLAS (or the FP8 GEMM) as the model ran before, or the fused decode Linears."""
    import torch.nn.functional as F

    from hsmc.ops import fused as fk
    from hsmc.ops.decode_linear import decode_linear
    from hsmc.ops.fp8_gemm import Fp8GemmPlan, fp8_gemm
    from hsmc.ops.fp8_linear import QWEN_BLOCK

    def lin(t, w, **kw):
        if fused:
            return decode_linear(t, w[0], scale=w[1], scale_block=QWEN_BLOCK, **kw)
        if w[1] is None:
            return F.linear(t, w[0])
        return fp8_gemm(t, w[0], w[1], QWEN_BLOCK, Fp8GemmPlan(16, 64, 128, 4))

    q = dims["o"][1]
    stream = x
    for layer in layers:
        if fused:
            qkv = lin(stream, layer["qkv"], norm=(layer["norm1"], 1e-6))
            stream = lin(qkv[:, :q], layer["o"], residual=stream)
            gu = lin(stream, layer["gate_up"], norm=(layer["norm2"], 1e-6))
            stream = lin(gu, layer["down"], silu_mul=True, residual=stream)
        else:
            qkv = lin(fk.rms_norm(stream, layer["norm1"], 1e-6), layer["qkv"])
            stream = stream + lin(qkv[:, :q], layer["o"])
            gu = lin(fk.rms_norm(stream, layer["norm2"], 1e-6), layer["gate_up"])
            stream = stream + lin(fk.silu_mul(gu), layer["down"])
    return stream


def graph_ms(fn) -> float:
    """Median time of one replay of fn captured in a CUDA graph."""
    import triton

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return triton.testing.do_bench(g.replay, return_mode="median", warmup=25, rep=100)


def check_linears() -> None:
    """Whole-model chains of the decoder Linears at one row, then tile settings per Linear."""
    bandwidth = copy_bandwidth(DEVICE)
    say(f"linears: copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    out = results.setdefault("linears", {"bandwidth": bandwidth})
    for shape, fp8 in (("qwen3-8b", False), ("qwen3-32b", True), ("qwen3-8b", True)):
        time_linear_chain(shape, fp8, bandwidth, out)
        gc.collect()
        torch.cuda.empty_cache()


def time_linear_chain(shape: str, fp8: bool, bandwidth: float, out: dict) -> None:
    """All layers' Linears of `shape` chained in one graph: the fused one-row kernels with and without PDL, and
    (bf16) the separate norm / SiLU / add kernels around cuBLAS; the first two layers' outputs compared with
    the separate path (FP8: the tensor-core FP8 GEMM)."""
    from hsmc.ops import pdl

    layers, dims = layer_linears_of(shape, fp8)
    nbytes = sum(w[0].numel() * w[0].element_size() + (0 if w[1] is None else w[1].numel() * 4)
                 for layer in layers for name, w in layer.items() if name in dims)  # fmt: skip
    tag = f"{shape} {'fp8' if fp8 else 'bf16'}"
    x = torch.randn(1, dims["o"][0], device=DEVICE, dtype=torch.bfloat16)
    ref = linear_chain(layers[:2], dims, x, fused=False)
    got = linear_chain(layers[:2], dims, x, fused=True)
    err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
    times = {"fused+pdl": graph_ms(lambda: linear_chain(layers, dims, x, fused=True))}
    original = pdl.pdl_supported
    pdl.pdl_supported = lambda device: False
    try:
        times["fused"] = graph_ms(lambda: linear_chain(layers, dims, x, fused=True))
        if not fp8:
            times["separate"] = graph_ms(lambda: linear_chain(layers, dims, x, fused=False))
    finally:
        pdl.pdl_supported = original
    floor = nbytes / bandwidth * 1e3
    cells = ", ".join(f"{k} {v:.3f} ms ({floor / v:.0%})" for k, v in times.items())
    say(f"  {tag} M=1: weight read {floor:.3f} ms; {cells}; 2-layer rel err vs separate {err:.1e}")
    out[f"{tag} M=1"] = {"floor_ms": floor, **times, "rel_err": err}
    sweep_linears(layers, dims, tag, bandwidth, out)


def sweep_linears(layers: list[dict], dims: dict, tag: str, bandwidth: float, out: dict) -> None:
    """Per Linear kind, all layers' instances chained with PDL at one row, over tile settings."""
    from hsmc.ops.decode_linear import DecodeLinearPlan, decode_linear
    from hsmc.ops.fp8_linear import QWEN_BLOCK

    fp8 = layers[0]["qkv"][1] is not None
    kinds = {"qkv": dict(norm=True), "o": dict(residual=True), "gate_up": dict(norm=True),
             "down": dict(silu=True, residual=True)}  # fmt: skip
    # (rows per program, K tile, warps, pipeline stages, fused prologue)
    settings = (
        [(8, 1024, 4, 3, False), (8, 512, 4, 3, False), (4, 1024, 4, 3, False), (8, 1024, 4, 4, False),
         (16, 1024, 8, 3, False), (8, 1024, 4, 3, True)]
        if fp8 else
        [(8, 1024, 4, 1, True), (16, 512, 4, 1, True), (4, 1024, 4, 1, True), (8, 1024, 4, 1, False),
         (16, 512, 4, 1, False)]
    )  # fmt: skip
    for kind, how in kinds.items():
        n, k = dims[kind]
        x = torch.randn(1, 2 * k if how.get("silu") else k, device=DEVICE, dtype=torch.bfloat16)
        res = torch.randn(1, n, device=DEVICE, dtype=torch.bfloat16)
        nbytes = sum(layer[kind][0].numel() * layer[kind][0].element_size() for layer in layers)
        rows = []
        for setting in settings:
            plan = DecodeLinearPlan(*setting)

            def chain(plan=plan):
                for layer in layers:
                    w, s = layer[kind]
                    norm = (layer["norm1"], 1e-6) if how.get("norm") else None
                    residual = res if how.get("residual") else None
                    decode_linear(x, w, scale=s, scale_block=QWEN_BLOCK, plan=plan, norm=norm,
                                  silu_mul=bool(how.get("silu")), residual=residual)  # fmt: skip

            ms = graph_ms(chain)
            rows.append((*setting, ms, nbytes / ms / 1e9))
        best = min(rows, key=lambda r: r[-2])
        say(f"  sweep {tag} {kind} [{n}x{k}] x{len(layers)}: best {best[:-2]}: {best[-2]:.3f} ms = "
            f"{best[-1]:.2f} TB/s ({best[-1] * 1e12 / bandwidth:.0%} of copy); "
            + " ".join(f"{r[:-2]}:{r[-1]:.2f}" for r in rows))  # fmt: skip
        out[f"sweep {tag} {kind}"] = rows


def few_row_chain(layers: list[dict], dims: dict, x: torch.Tensor, path: str, plans: dict | None = None):
    """A decoder's Linears at a few rows without attention (o reads the first columns of qkv): `cublas` (norm /
    SiLU kernels, then cuBLAS with the residual as its beta term, the path before the few-row kernels) or `few`
    (norm / SiLU kernels, then the few-row kernels, with `plans` per Linear kind or the planner's)."""
    import torch.nn.functional as F

    from hsmc.ops import fused as fk
    from hsmc.ops.few_row_linear import few_row_linear

    plans = plans or {}
    q = dims["o"][1]
    stream = x
    for layer in layers:
        if path == "cublas":
            qkv = F.linear(fk.rms_norm(stream, layer["norm1"], 1e-6), layer["qkv"][0])
            stream = torch.addmm(stream, qkv[:, :q], layer["o"][0].t())
            gu = F.linear(fk.rms_norm(stream, layer["norm2"], 1e-6), layer["gate_up"][0])
            stream = torch.addmm(stream, fk.silu_mul(gu), layer["down"][0].t())
        else:
            qkv = few_row_linear(stream, layer["qkv"][0], norm=(layer["norm1"], 1e-6), plan=plans.get("qkv"))
            stream = few_row_linear(qkv[:, :q], layer["o"][0], residual=stream, plan=plans.get("o"))
            gu = few_row_linear(stream, layer["gate_up"][0], norm=(layer["norm2"], 1e-6), plan=plans.get("gate_up"))
            stream = few_row_linear(gu, layer["down"][0], silu_mul=True, residual=stream, plan=plans.get("down"))
    return stream


def check_few_linears() -> None:
    """The 8B and 32B decoder Linears (bf16) at 1..16 rows, all layers chained in one graph: per Linear kind, a
    sweep of the few-row kernel's settings at 8 rows; then the whole chain on the current path (one row: the
    fused one-row kernels; more: the few-row kernels) against the path before them (norm / SiLU kernels +
    cuBLAS) and the sweep's best settings; the kernels' rounding against the torch reference; and the whole
    8B forward at 1..16 rows with the few-row kernels and with cuBLAS."""
    bandwidth = copy_bandwidth(DEVICE)
    say(f"fewlinears: copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    out = results.setdefault("fewlinears", {"bandwidth": bandwidth})
    for shape in ("qwen3-8b", "qwen3-32b"):
        time_few_row_chains(shape, bandwidth, out)
        gc.collect()
        torch.cuda.empty_cache()
    few_row_forwards_8b(out)


def time_few_row_chains(shape: str, bandwidth: float, out: dict) -> None:
    """All layers' Linears of `shape` (bf16) chained in one graph per row count; the first two layers' outputs
    of the current path compared with cuBLAS's."""
    layers, dims = layer_linears_of(shape, False)
    nbytes = sum(layer[name][0].numel() * 2 for layer in layers for name in dims)
    floor = nbytes / bandwidth * 1e3
    if shape == "qwen3-8b":
        few_row_rounding(layers[0], dims, out)
    best = {kind: won[0] for kind, won in sweep_few_linears(layers, dims, shape, bandwidth, out).items()}
    for m in (1, 2, 4, 8, 16):
        x = torch.randn(m, dims["o"][0], device=DEVICE, dtype=torch.bfloat16)

        def current(layers=layers, x=x, m=m):
            return linear_chain(layers, dims, x, fused=True) if m == 1 else few_row_chain(layers, dims, x, "few")

        ref = few_row_chain(layers[:2], dims, x, "cublas").float()
        err = ((current(layers[:2]).float() - ref).norm() / ref.norm()).item()
        times = {"cublas": graph_ms(lambda: few_row_chain(layers, dims, x, "cublas")), "current": graph_ms(current),
                 "best": graph_ms(lambda: few_row_chain(layers, dims, x, "few", best))}  # fmt: skip
        cells = ", ".join(f"{k} {v:.3f} ms ({floor / v:.1%})" for k, v in times.items())
        say(f"  {shape} bf16 M={m}: weight read {floor:.3f} ms; {cells}; current/cublas "
            f"{times['current'] / times['cublas']:.3f}; 2-layer rel err current vs cublas {err:.1e}")  # fmt: skip
        out[f"{shape} M={m}"] = {"floor_ms": floor, **times, "rel_err": err}


def few_row_rounding(layer: dict, dims: dict, out: dict) -> None:
    """Each Linear step of one layer through the few-row kernel vs the torch reference (`TorchBackend`'s ops)
    in bf16: the largest difference in bf16 ulps at the value's scale, and the share of bit-equal outputs."""
    import torch.nn.functional as F

    from hsmc.ops.backend import rms_norm_reference
    from hsmc.ops.few_row_linear import FewRowPlan, few_row_linear

    q = dims["o"][1]
    eps = torch.finfo(torch.bfloat16).eps
    for m in (2, 8, 16):
        stream = torch.randn(m, dims["o"][0], device=DEVICE, dtype=torch.bfloat16)
        gu = torch.randn(m, dims["gate_up"][0], device=DEVICE, dtype=torch.bfloat16)
        qkv_in = torch.randn(m, dims["qkv"][0], device=DEVICE, dtype=torch.bfloat16)
        gate, up = gu.chunk(2, -1)
        cases = {
            "qkv": (lambda p: few_row_linear(stream, layer["qkv"][0], norm=(layer["norm1"], 1e-6), plan=p),
                    F.linear(rms_norm_reference(stream, layer["norm1"], 1e-6), layer["qkv"][0])),
            "o": (lambda p: few_row_linear(qkv_in[:, :q], layer["o"][0], residual=stream, plan=p),
                  stream + F.linear(qkv_in[:, :q], layer["o"][0])),
            "down": (lambda p: few_row_linear(gu, layer["down"][0], silu_mul=True, residual=stream, plan=p),
                     stream + F.linear(F.silu(gate) * up, layer["down"][0])),
        }  # fmt: skip
        for name, (run, want) in cases.items():
            for tag, plan in (("planned", None), ("split", FewRowPlan(32, 128, 4))):
                got = run(plan).float()
                ulps = ((got - want.float()).abs() / (want.float().abs().clamp_min(1) * eps)).max().item()
                same = (got == want.float()).float().mean().item()
                say(f"  rounding M={m} {name} {tag}: max {ulps:.2f} ulp, {same:.1%} bit-equal to the reference")
                out[f"rounding M={m} {name} {tag}"] = {"max_ulp": ulps, "equal": same}


def sweep_few_linears(
    layers: list[dict], dims: dict, shape: str, bandwidth: float, out: dict, settings=None, rounds: int = 1, m: int = 8
) -> dict:
    """Per Linear kind (and the LM head, four times, for the 8B), all layers' instances chained (PDL) at m rows,
    over the few-row kernel's settings, the planner's and cuBLAS's (after the norm / SiLU kernel, as the path
    before ran it), each the median of `rounds` interleaved rounds; returns per kind (best plan, its ms, cuBLAS's)."""
    import torch.nn.functional as F

    from hsmc.ops import fused as fk
    from hsmc.ops.few_row_linear import FewRowPlan, few_row_linear, plan_few_row_linear

    kinds = {"qkv": dict(norm=True), "o": dict(residual=True), "gate_up": dict(norm=True),
             "down": dict(silu=True, residual=True)}  # fmt: skip
    weights = {kind: [layer[kind][0] for layer in layers] for kind in kinds}
    if shape == "qwen3-8b":
        kinds["lm_head"] = dict(norm=True)
        lm_head = torch.randn(shape_config(shape).vocab_size, dims["o"][0], device=DEVICE, dtype=torch.bfloat16)
        weights["lm_head"] = [lm_head / 64] * 4
    # (weight rows per program, K tile, K splits, warps, stages)
    settings = settings or [
        (32, 256, 1, 2, 3), (32, 256, 1, 2, 5), (32, 256, 1, 1, 4), (16, 256, 1, 1, 4), (16, 256, 1, 2, 4),
        (32, 512, 1, 2, 3), (32, 128, 1, 2, 6), (64, 128, 1, 2, 4), (64, 256, 1, 4, 4), (32, 256, 1, 4, 4),
        (64, 128, 1, 4, 4), (64, 128, 2, 4, 4), (64, 128, 3, 4, 4), (32, 256, 2, 2, 4)]  # fmt: skip
    norm = layers[0]["norm1"]
    best, cublas_ms = {}, {}
    for kind, how in kinds.items():
        n, k = weights[kind][0].shape
        x = torch.randn(m, 2 * k if how.get("silu") else k, device=DEVICE, dtype=torch.bfloat16)
        res = torch.randn(m, n, device=DEVICE, dtype=torch.bfloat16)
        nbytes = sum(w.numel() * 2 for w in weights[kind])

        def cublas():
            for w in weights[kind]:
                if how.get("norm"):
                    F.linear(fk.rms_norm(x, norm, 1e-6), w)
                else:
                    torch.addmm(res, fk.silu_mul(x) if how.get("silu") else x, w.t())

        planned = plan_few_row_linear(n, k, m, DEVICE)
        timings: dict = {"cublas": [graph_ms(cublas)]}
        for _ in range(rounds):  # interleaved, so a clock or thermal drift hits every setting alike
            for setting in [planned] + [FewRowPlan(*s) for s in settings]:

                def chain(plan=setting):
                    for w in weights[kind]:
                        few_row_linear(x, w, plan=plan, norm=(norm, 1e-6) if how.get("norm") else None,
                                       silu_mul=bool(how.get("silu")),
                                       residual=res if how.get("residual") else None)  # fmt: skip

                if timings.get(setting, [0.0])[-1] is None:
                    continue
                try:  # a setting that does not compile (shared memory, layouts) is a sweep result, not a failure
                    timings.setdefault(setting, []).append(graph_ms(chain))
                except Exception as e:
                    timings[setting] = [None]
                    say(f"  sweep {shape} {kind} {setting}: {type(e).__name__}: {str(e)[:200]}")
        medians = {setting: sorted(ms)[len(ms) // 2] for setting, ms in timings.items() if ms[-1] is not None}
        rows = [(setting, ms, nbytes / ms / 1e9) for setting, ms in medians.items()]
        best[kind], cublas_ms[kind] = min(rows[1:], key=lambda r: r[1]), rows[0][1]
        label = lambda p: f"{p.block_n}/{p.block_k}/{p.split_k}/{p.num_warps}/{p.num_stages}"  # noqa: E731
        say(f"  sweep {shape} M={m} {kind} [{n}x{k}] x{len(weights[kind])}: cublas {rows[0][1]:.3f} ms = "
            f"{rows[0][2]:.2f} TB/s ({rows[0][2] * 1e12 / bandwidth:.0%}); planned {label(rows[1][0])}: "
            f"{rows[1][2]:.2f} TB/s ({rows[1][2] * 1e12 / bandwidth:.0%}); best {label(best[kind][0])}: "
            f"{best[kind][1]:.3f} ms = {best[kind][2]:.2f} TB/s ({best[kind][2] * 1e12 / bandwidth:.0%} of copy); "
            + " ".join(f"{label(r[0])}:{r[2]:.2f}" for r in rows[2:]))  # fmt: skip
        out[f"sweep {shape} M={m} {kind}"] = [(str(r[0]), r[1], r[2]) for r in rows]
    return {kind: (row[0], row[1], cublas_ms[kind]) for kind, row in best.items()}


def few_row_forwards_8b(out: dict) -> None:
    """The whole Qwen3-8B forward (graph replay, 260 keys per row) at 1..16 rows, the dense Linears through the
    few-row kernels (the backend's route) and through cuBLAS (the route patched off)."""
    import hsmc.ops.triton_backend as triton_backend

    route = triton_backend._few_rows

    def use(name: str) -> None:
        triton_backend._few_rows = route if name == "few" else (lambda x, linear: False)

    try:
        times = forwards_8b((1, 2, 4, 8, 16), ("cublas", "few"), use, rounds=1)
    finally:
        triton_backend._few_rows = route
    for m, t in times.items():
        say(f"  8B forward M={m} (graph, 260 keys): weight read {t['floor_ms']:.3f} ms; cublas "
            f"{t['cublas']:.3f} ms, few {t['few']:.3f} ms; few/cublas {t['few'] / t['cublas']:.3f}")  # fmt: skip
        out[f"8B forward M={m}"] = t


def forwards_8b(row_counts: tuple[int, ...], variants: tuple[str, ...], use, rounds: int) -> dict[int, dict]:
    """ms of one whole Qwen3-8B step (random bf16, graph replay, 260 keys per row) per row count and variant;
    `use(variant)` sets the route before the graphs are captured again; variants interleaved over `rounds`,
    the median kept."""
    cfg = DecoderConfig.from_hf(hf_config("qwen3-8b"))
    context, width = 260, 300
    tables = BlockTables(SlotAllocator(max(row_counts) * width, "cuda"), max(row_counts), width)
    model = random_model(cfg, torch.bfloat16, "cuda")
    runner = ModelRunner(model, tables, TritonBackend(), cfg.num_layers, cuda_graphs=True)
    floor = weight_bytes(model) / copy_bandwidth(DEVICE) * 1e3
    times = {}
    for m in row_counts:
        rows = torch.arange(m, device="cuda")
        one = torch.ones(m, dtype=torch.int64, device="cuda")
        with torch.inference_mode():
            tables.release(rows, width)
            prompt = torch.randint(0, 1000, (m, context), device="cuda")
            runner.forward(runner.new_tokens(rows, prompt, one * context, context), True)
        samples: dict[str, list[float]] = {}
        for _ in range(rounds):
            for name in variants:
                use(name)
                runner.graphs.captured.clear()
                tokens = torch.randint(0, 1000, (m, 1), device="cuda")
                back = torch.full_like(rows, context)
                with torch.inference_mode():
                    step = lambda: runner.forward(runner.new_tokens(rows, tokens, one, context + 1), True)  # noqa: E731
                    step()
                    tables.truncate(rows, back, 1)
                    ms = timed(lambda: [(step(), tables.truncate(rows, back, 1)) for _ in range(50)]) / 50 * 1e3
                samples.setdefault(name, []).append(ms)
        times[m] = {"floor_ms": floor} | {name: sorted(v)[len(v) // 2] for name, v in samples.items()}
    return times


# (weight rows per program, K tile, K splits, warps, stages) tried by `fewplans` besides the default plan
PLAN_CANDIDATES = [
    (32, 256, 1, 2, 3), (32, 256, 1, 2, 5), (32, 128, 1, 2, 6), (32, 128, 1, 2, 8), (64, 128, 1, 2, 4),
    (64, 128, 1, 2, 5), (64, 128, 1, 4, 4), (64, 128, 1, 4, 6), (64, 128, 1, 4, 8), (32, 128, 1, 4, 6),
    (64, 128, 3, 4, 4), (32, 256, 2, 2, 4), (32, 512, 1, 2, 3), (128, 64, 1, 4, 4), (64, 64, 1, 4, 8),
    (64, 256, 1, 4, 3), (16, 256, 1, 1, 4)]  # fmt: skip


def check_few_plans() -> None:
    """The measured plans of `few_row_linear.MEASURED_PLANS` for this GPU: each Qwen3-8B Linear kind and the LM head
    swept at 8 rows (the 16-row tile) and at 32 rows (the 32-row tile; kept where it beat cuBLAS), the median of 3
    interleaved rounds, the winners printed as the table's entries; then the 8B's Linears chained and the whole 8B
    step at 2..32 rows with the default route (default plans; cuBLAS past 16 rows) against the winners."""
    from dataclasses import astuple

    from hsmc.ops import few_row_linear as frl

    bandwidth = copy_bandwidth(DEVICE)
    name = frl.gpu_name(DEVICE)
    say(f"fewplans: {name}, copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    out = results.setdefault("fewplans", {"bandwidth": bandwidth})
    kept = frl.MEASURED_PLANS.pop(name, None)
    try:
        layers, dims = layer_linears_of("qwen3-8b", False)
        shapes = dict(dims, lm_head=(shape_config("qwen3-8b").vocab_size, dims["o"][0]))
        table, won = {}, {}
        for tile, m in ((16, 8), (32, 32)):
            swept = sweep_few_linears(layers, dims, "qwen3-8b", bandwidth, out, PLAN_CANDIDATES, rounds=3, m=m)
            won[tile] = {kind: plan for kind, (plan, ms, cublas) in swept.items() if tile == 16 or ms < cublas}
            table |= {(*shapes[kind], tile): plan for kind, plan in won[tile].items()}
        say(f"  measured plans for {name!r}:")
        for (n, k, tile), plan in table.items():
            say(f"        ({n}, {k}, {tile}): FewRowPlan{astuple(plan)},")
        out["table"] = [[*key, *astuple(plan)] for key, plan in table.items()]
        for m in (2, 8, 16, 24, 32):
            x = torch.randn(m, dims["o"][0], device=DEVICE, dtype=torch.bfloat16)
            plans = won[frl.row_tile(m)]
            paths = {"default": lambda: few_row_chain(layers, dims, x, "few" if m <= 16 else "cublas"),
                     "measured": lambda: few_row_chain(layers, dims, x, "few", plans)}  # fmt: skip
            t = {path: sorted(graph_ms(run) for _ in range(5))[2] for path, run in paths.items()}
            say(f"  8B Linears chained M={m}: default {t['default']:.3f} ms, measured {t['measured']:.3f} ms "
                f"({t['measured'] / t['default']:.3f}x)")  # fmt: skip
            out[f"chain M={m}"] = t
        layers.clear()  # free the chains before the whole model
        gc.collect()
        torch.cuda.empty_cache()

        def use(variant: str) -> None:
            frl.MEASURED_PLANS[name] = table if variant == "measured" else {}

        for m, t in forwards_8b((2, 8, 16, 24, 32), ("default", "measured"), use, rounds=3).items():
            say(f"  8B step M={m} (graph, 260 keys): weight read {t['floor_ms']:.3f} ms; default {t['default']:.3f} "
                f"ms, measured {t['measured']:.3f} ms ({t['measured'] / t['default']:.3f}x)")  # fmt: skip
            out[f"8B step M={m}"] = t
    finally:
        frl.MEASURED_PLANS.pop(name, None)
        if kept is not None:
            frl.MEASURED_PLANS[name] = kept


def check_fp8_linears() -> None:
    """The FP8 decoder Linears (Qwen's 128x128 blocks) at the row counts the headline stack runs (an SMC
    proposal's particles; a verify of rows x (K+1) tokens), all layers of a kind chained in one graph: the
    weight-only route (norm / SiLU kernel, then `fp8_gemm`) against FP8 activations (`w8a8_gemm`, planned) and
    bf16 cuBLAS on the dequantized weights; the outputs against their references. (The sweep behind the
    planner, and the weight-only few-row and `torch._scaled_mm` variants tried: docs/measurements/2026-11-24-h200-
    fp8-w8a8-sweep.txt, -fp8-few-row-tried.txt.)"""
    from hsmc.ops.fp8_gemm import quantize_groups
    from hsmc.ops.fp8_linear import FP8_DTYPE, FP8_MAX

    bandwidth = copy_bandwidth(DEVICE)
    say(f"fp8linears: copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    out = results.setdefault("fp8linears", {"bandwidth": bandwidth})
    x = (torch.randn(64, 25600, device=DEVICE) * torch.logspace(-4, 3, 64, device=DEVICE)[:, None]).bfloat16()
    q, scale = quantize_groups(x, 128)
    blocks = x.float().view(64, -1, 128)
    want_scale = (blocks.abs().amax(-1) / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    want_q = (blocks / want_scale[..., None]).to(FP8_DTYPE).view(64, -1)
    same = torch.equal(scale, want_scale) and torch.equal(q.float(), want_q.float())
    say(f"  quantize_groups (Triton) vs torch on 64 x 25600 bf16 rows: {'bit-equal' if same else 'DIFFERENT'}")
    out["quantize_equal"] = same
    for shape, rows in (("qwen3-32b", (2, 8, 16, 72, 144, 256)), ("qwen3-8b", (8, 32, 72))):
        layers, dims = layer_linears_of(shape, True)
        for m in rows:
            time_fp8_linears(layers, dims, shape, m, bandwidth, out)
        layers.clear()  # free the chains before the whole model
        gc.collect()
        torch.cuda.empty_cache()


def fp8_route(x, w, s, how: dict, norm, res, dynamic: bool):
    """One FP8 Linear step over rows > 1 as the Triton backend runs it: norm / SiLU kernel, then the FP8 GEMM."""
    from hsmc.ops import fused as fk
    from hsmc.ops.fp8_linear import QWEN_BLOCK, fp8_linear

    if how.get("norm"):
        x = fk.rms_norm(x, norm, 1e-6)
    elif how.get("silu"):
        x = fk.silu_mul(x)
    return fp8_linear(x, w, s, None, QWEN_BLOCK, res if how.get("residual") else None, dynamic)


def time_fp8_linears(layers: list[dict], dims: dict, shape: str, m: int, bandwidth: float, out: dict) -> None:
    import torch.nn.functional as F

    from hsmc.ops.fp8_linear import QWEN_BLOCK, dequantize_fp8, quantize_activations

    kinds = {"qkv": dict(norm=True), "o": dict(residual=True), "gate_up": dict(norm=True),
             "down": dict(silu=True, residual=True)}  # fmt: skip
    norm = layers[0]["norm1"]
    totals = {"weight-only": 0.0, "fp8 activations": 0.0, "bf16 cublas": 0.0}
    floor_total = 0.0
    cells = []
    for kind, how in kinds.items():
        n, k = dims[kind]
        x = torch.randn(m, 2 * k if how.get("silu") else k, device=DEVICE, dtype=torch.bfloat16)
        res = torch.randn(m, n, device=DEVICE, dtype=torch.bfloat16)
        floor = sum(layer[kind][0].numel() + layer[kind][1].numel() * 4 for layer in layers) / bandwidth * 1e3
        floor_total += floor
        times = {}
        for name, dynamic in (("weight-only", False), ("fp8 activations", True)):
            times[name] = graph_ms(
                lambda d=dynamic: [fp8_route(x, *layer[kind], how, norm, res, d) for layer in layers]
            )
        dense = [dequantize_fp8(*layer[kind], QWEN_BLOCK, torch.bfloat16) for layer in layers]
        xin = x if not how.get("silu") else x[:, :k].contiguous()
        times["bf16 cublas"] = graph_ms(lambda: [F.linear(xin, d) for d in dense])
        reference = dense_step(x, dense[0], how, norm, res).float()
        dense.clear()
        torch.cuda.empty_cache()
        for name in totals:
            totals[name] += times[name]
        errs = {}
        for name, dynamic in (("weight-only", False), ("fp8 activations", True)):
            got = fp8_route(x, *layers[0][kind], how, norm, res, dynamic).float()
            errs[name] = ((got - reference).norm() / reference.norm()).item()
        # the FP8-activation GEMM against its own definition: the same product on the quantized input
        dq = dequantize_fp8(*layers[0][kind], QWEN_BLOCK, torch.float32)
        xq = dense_input(x, how, norm)
        own = (quantize_activations(xq, 128).float() @ dq.T).bfloat16().float() + (
            res.float() if how.get("residual") else 0
        )
        got = fp8_route(x, *layers[0][kind], how, norm, res, True).float()
        errs["fp8 activations vs own reference"] = ((got - own).norm() / own.norm()).item()
        out[f"{shape} M={m} {kind}"] = {"times_ms": times, "floor_ms": floor, "rel_err": errs}
        cells.append(f"{kind} " + "/".join(f"{floor / t:.0%}" for t in times.values()))
        say(f"    {shape} M={m} {kind}: rel err vs dequantized bf16: weight-only {errs['weight-only']:.1e}, fp8 "
            f"activations {errs['fp8 activations']:.1e} (vs its own reference "
            f"{errs['fp8 activations vs own reference']:.1e})")  # fmt: skip
    say(f"  fp8 {shape} M={m}: weight read {floor_total:.3f} ms; "
        + ", ".join(f"{name} {ms:.3f} ms ({floor_total / ms:.1%})" for name, ms in totals.items())
        + f"; per kind (weight-only/fp8 act/bf16): {'; '.join(cells)}")  # fmt: skip


def check_w8a8_sweep() -> None:
    """Tile settings of the FP8-activation GEMM at verify sizes (32B Linears, all layers of a kind chained):
    both operand orders, the planner's choice first."""
    import triton

    from hsmc.ops import fused as fk
    from hsmc.ops.fp8_gemm import W8A8Plan, plan_w8a8, w8a8_gemm
    from hsmc.ops.fp8_linear import QWEN_BLOCK
    from hsmc.ops.split_k import splits_to_fill

    bandwidth = copy_bandwidth(DEVICE)
    out = results.setdefault("w8a8sweep", {"bandwidth": bandwidth})
    layers, dims = layer_linears_of("qwen3-32b", True)
    kinds = {"qkv": dict(norm=True), "o": dict(residual=True), "gate_up": dict(norm=True),
             "down": dict(silu=True, residual=True)}  # fmt: skip
    settings = [(64, 128, 4, 4, True), (128, 64, 4, 4, True), (64, 128, 4, 4, False), (64, 128, 4, 3, False),
                (128, 128, 8, 3, False), (128, 128, 4, 3, False), (64, 256, 8, 3, False), (128, 256, 8, 3, False),
                (64, 64, 4, 5, False), (32, 128, 4, 4, False)]  # fmt: skip
    for m in (72, 144, 256):
        totals: dict[str, float] = {}
        floor_total = 0.0
        for kind, how in kinds.items():
            n, k = dims[kind]
            x = torch.randn(m, 2 * k if how.get("silu") else k, device=DEVICE, dtype=torch.bfloat16)
            res = torch.randn(m, n, device=DEVICE, dtype=torch.bfloat16) if how.get("residual") else None
            floor_total += sum(lay[kind][0].numel() + lay[kind][1].numel() * 4 for lay in layers) / bandwidth * 1e3

            def plan_of(bm, bn, warps, stages, swap):
                split = splits_to_fill(triton.cdiv(n, bn) * triton.cdiv(m, bm), triton.cdiv(k, 128), DEVICE)
                return W8A8Plan(bm, bn, split, warps, stages, swap)

            plans = {"planned": plan_w8a8(m, n, k, 128, DEVICE)}
            plans.update({f"{'s' if st[4] else 'n'}{st[0]}x{st[1]}/{st[2]}/{st[3]}": plan_of(*st) for st in settings})
            for label, plan in plans.items():

                def chain(plan=plan):
                    for layer in layers:
                        h = fk.rms_norm(x, layer["norm1"], 1e-6) if how.get("norm") else x
                        h = fk.silu_mul(h) if how.get("silu") else h
                        w8a8_gemm(h, *layer[kind], QWEN_BLOCK, plan, res)

                try:
                    ms = graph_ms(chain)
                except Exception as e:  # a setting that does not compile is a sweep result
                    say(f"  w8a8 M={m} {kind} {label}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                    continue
                totals[label] = totals.get(label, 0.0) + ms
                out[f"M={m} {kind} {label}"] = ms
        ranked = sorted(((ms, label) for label, ms in totals.items()), key=lambda t: t[0])
        say(f"  w8a8 32B M={m}: weight read {floor_total:.3f} ms; "
            + ", ".join(f"{label} {ms:.2f} ms ({floor_total / ms:.0%})" for ms, label in ranked))  # fmt: skip


def dense_input(x, how: dict, norm):
    """The input a Linear step multiplies (after its norm or SiLU·mul), in x's dtype."""
    import torch.nn.functional as F

    from hsmc.ops.backend import rms_norm_reference

    if how.get("norm"):
        return rms_norm_reference(x, norm, 1e-6)
    if how.get("silu"):
        gate, up = x.chunk(2, -1)
        return F.silu(gate) * up
    return x


def dense_step(x, w, how: dict, norm, res):
    """The reference of one Linear step on dense weights (the torch backend's math, bf16 cuBLAS)."""
    import torch.nn.functional as F

    y = F.linear(dense_input(x, how, norm), w)
    return res + y if how.get("residual") else y


def check_decode_attention() -> None:
    """The whole Qwen3-8B one-row decode forward (graph replay, PDL chain) with the attention plan forced to
    each setting, at a short and a long context: where the planner's choice shows in the step time."""
    import hsmc.ops.triton_backend as triton_backend
    from hsmc.ops.paged_attention import AttentionPlan

    say("== decode attention plans inside the 8B one-row forward ==")
    runner, tables, rows, one = one_row_runner_8b(8192)
    planner = triton_backend.plan_attention
    out = {}
    try:
        for context in (260, 2000):
            with torch.inference_mode():
                tables.release(rows, 8192)
                runner.forward(runner.new_tokens(rows, torch.randint(0, 1000, (1, context), device="cuda"),
                                                 one * context, context), True)  # fmt: skip
            timings = {}
            for plan in [None] + [AttentionPlan(4, 16, s, b, w) for s in (1, 2, 4, 8, 16) for b in (32, 64, 128)
                                  for w in (2, 4)]:  # fmt: skip
                triton_backend.plan_attention = planner if plan is None else (lambda *a, p=plan: p)
                runner.graphs.captured.clear()
                tokens = torch.randint(0, 1000, (1, 1), device="cuda")
                with torch.inference_mode():
                    step = lambda: runner.forward(runner.new_tokens(rows, tokens, one, context + 1), True)  # noqa: E731
                    step()
                    tables.truncate(rows, torch.full_like(rows, context), 1)
                    t = timed(lambda: [(step(), tables.truncate(rows, torch.full_like(rows, context), 1))
                                       for _ in range(50)]) / 50  # fmt: skip
                timings["planner" if plan is None else f"{plan.splits}x{plan.block_n}/{plan.num_warps}w"] = t * 1e3
            best = min(timings, key=timings.get)
            cells = " ".join(f"{k}:{v:.3f}" for k, v in timings.items())
            planned = timings["planner"]
            say(f"context {context}: planner {planned:.3f} ms per forward; best {best} {timings[best]:.3f} ms; {cells}")
            out[context] = timings
    finally:
        triton_backend.plan_attention = planner
    results["decode_attention"] = out


def check_blas_routes() -> None:
    """The entries of `gemm_routes.CUBLASLT_GEMMS` and `PADDED_ROWS` for this GPU: each Qwen3-8B / 32B matrix (the LM
    heads included) at the rows its cuBLAS GEMMs take in the stacks (verifies of N x (K + 1) tokens, batched
    rejection rounds and proposal steps), through cuBLAS and cuBLASLt, called as `_matmul` calls it (the residual
    accumulated in place for `o` and `down`), four copies chained in a graph, the median of 3 interleaved rounds;
    printed where cuBLASLt was >= 2 % faster. The 32B's matrices after an RMSNorm (`qkv`, `gate_up`, LM head) also run
    at 8..32 more rows (cuBLAS; the norm would write the taller input for free), printed where the fastest of those
    beat the rows' own route by >= 2 %. And the largest relative difference of the products of the two libraries and
    of the taller GEMMs' first rows."""
    import torch.nn.functional as F

    from hsmc.ops.few_row_linear import gpu_name

    bw = copy_bandwidth(DEVICE)
    out = results.setdefault("blasroutes", {"bandwidth": bw})
    faster, padded, worst = [], [], 0.0
    sizes = {"qwen3-32b": (72, 102, 144, 288, 408, 576, 1152), "qwen3-8b": (48, 64, 72, 120, 128, 144)}

    def median_us(fn, lib: str) -> float:
        torch.backends.cuda.preferred_blas_library(lib)
        return graph_ms(fn) / 4 * 1e3

    for shape, row_counts in sizes.items():
        _, dims = layer_linears_of(shape, False, layers=1)
        dims = dims | {"lm_head": (shape_config(shape).vocab_size, dims["o"][0])}
        for name, (n, k) in dims.items():
            ws = [torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) for _ in range(4)]
            for m in row_counts:
                norm_fed = shape == "qwen3-32b" and name not in ("o", "down")
                taller = [m + 8 * j for j in range(1, 5)] if norm_fed else []
                x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)  # the taller inputs start with its rows
                xs = {r: torch.cat([x, torch.randn(r - m, k, device=DEVICE, dtype=x.dtype)]) for r in taller}
                res = torch.randn(m, n, device=DEVICE, dtype=torch.bfloat16)
                fn = (lambda: [res.addmm_(x, w.t()) for w in ws]) if name in ("o", "down") else (
                    lambda: [F.linear(x, w) for w in ws])  # fmt: skip
                products = []
                for lib in ("cublas", "cublaslt"):
                    torch.backends.cuda.preferred_blas_library(lib)
                    products.append(F.linear(x, ws[0]).float())
                torch.backends.cuda.preferred_blas_library("cublas")
                products += [F.linear(xs[r], ws[0])[:m].float() for r in taller]
                worst = max([worst] + [((p - products[0]).norm() / products[0].norm()).item() for p in products[1:]])
                cells: dict[str, list[float]] = {}
                for _ in range(3):
                    for lib in ("cublas", "cublaslt"):
                        cells.setdefault(lib, []).append(median_us(fn, lib))
                    for r in taller:
                        gemms = lambda r=r: [F.linear(xs[r], w) for w in ws]  # noqa: E731
                        cells.setdefault(r, []).append(median_us(gemms, "cublas"))
                torch.backends.cuda.preferred_blas_library("cublas")
                med = {key: sorted(v)[1] for key, v in cells.items()}
                read_us = n * k * 2 / bw * 1e6
                tall = "; cublas at " + " ".join(f"{r}: {med[r]:.1f}" for r in taller) if taller else ""
                say(f"  {shape} {name} [{n}x{k}] M={m}: cublas {med['cublas']:.1f} us, cublaslt {med['cublaslt']:.1f} "
                    f"us ({med['cublaslt'] / med['cublas']:.3f}x; weight read {read_us:.1f} us){tall}")  # fmt: skip
                out[f"{shape}/{name}/{m}"] = {str(key): v for key, v in med.items()} | {"read_us": read_us}
                lt = med["cublaslt"] <= 0.98 * med["cublas"]
                if lt:
                    faster.append(f"({n}, {k}, {m}),  # {shape} {name}: {med['cublaslt'] / med['cublas']:.3f}x")
                own = med["cublaslt" if lt else "cublas"]
                best = min(taller, key=med.get, default=None)
                if best is not None and med[best] <= 0.98 * own:
                    padded.append(f"({n}, {k}, {m}): {best},  # {shape} {name}: {med[best] / own:.3f}x")
    say(f"  cuBLAS vs cuBLASLt vs taller products: largest relative difference {worst:.2e}")
    out["worst_rel_diff"] = worst
    for label, lines in ((f"cuBLASLt >= 2 % faster on {gpu_name(DEVICE)!r}", faster),
                         (f"more rows >= 2 % faster on {gpu_name(DEVICE)!r}", padded)):  # fmt: skip
        say(f"  {label}:")
        for line in lines:
            say(f"        {line}")
    out["faster"], out["padded"] = faster, padded


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sections", default="kernels,tiny,smollm2,bench,verify,profile")
    parser.add_argument("--gguf", type=Path, default=None)
    parser.add_argument("--device", default="cuda", help="cpu: the fp8 sections only, Triton interpreted")
    parser.add_argument("--tiny", action="store_true", help="fp8 sections at small shapes (a dry run of the script)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    global DEVICE, TINY
    DEVICE, TINY = torch.device(args.device), args.tiny
    name = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu"
    say(f"device {name}, torch {torch.__version__}{' (tiny shapes)' if TINY else ''}")
    sections = args.sections.split(",")
    steps = {
        "kernels": check_kernels,
        "vocab": check_vocab,
        "tiny": check_tiny,
        "smollm2": lambda: check_smollm2(args.gguf) if args.gguf else say("smollm2: no --gguf given, skipped"),
        "profile": check_profile,
        "profilesmc": check_profile_smc,
        "cyclekernels": check_cycle_kernels,
        "capture": check_capture_time,
        "sync8b": check_sync_8b,
        "attnvar": check_attention_variants,
        "verifyattn": check_verify_attention,
        "bench": check_bench,
        "verify": check_verify,
        "prefill": check_prefill,
        "verifygemm": check_verify_gemm_routes,
        "smcsync": check_smc_sync,
        "smcbench": check_smc_bench,
        "fp8gemm": check_fp8_gemm,
        "fp8decode": check_fp8_decode,
        "fp8logits": check_fp8_logits,
        "fp8stack": check_fp8_stack,
        "fp8rss": check_fp8_rss,
        "linears": check_linears,
        "fewlinears": check_few_linears,
        "fewplans": check_few_plans,
        "decodeattn": check_decode_attention,
        "rounds": check_rounds,
        "cycles": check_cycles,
        "fp8linears": check_fp8_linears,
        "w8a8sweep": check_w8a8_sweep,
        "blasroutes": check_blas_routes,
    }
    for name in sections:
        began = time.perf_counter()
        try:
            steps[name]()
        except Exception as e:  # keep going: one failing section must not hide the others' numbers
            import traceback

            traceback.print_exc()
            say(f"!! section {name} failed: {type(e).__name__}: {e}")
        say(f"(section {name}: {time.perf_counter() - began:.0f} s)")
        gc.collect()
        torch.cuda.empty_cache()
        (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
        (args.out / "summary.txt").write_text("\n".join(summary) + "\n")


if __name__ == "__main__":
    main()
