"""What the GPU benchmarks and sweeps share: the report (device, versions and copy bandwidth first, a line per
measurement, every row as JSON under --out), graph-replay timing, and random Qwen3-shaped decoder-layer weights."""

from __future__ import annotations

import argparse
import gc
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.testing

from hsmc.bench import copy_bandwidth
from hsmc.models.shapes import hf_config
from hsmc.ops.batch import ForwardBatch, padded_columns
from hsmc.ops.kv_cache import KVCache
from hsmc.ops.paged_attention import AttentionPlan, paged_attention, plan_attention, shared_columns

KV_HEADS, HEAD_DIM = 8, 128  # of the Qwen3-8B and 32B
FP8_PEAK_FLOPS = 1979e12  # the dense FP8 tensor-core peak of an H100 or H200 SXM (issue 30 states its bound so)
# Each decoder-layer Linear and the step around it: the norm before qkv and gate_up, the residual added by o and down,
# SiLU·mul before down
LINEAR_STEPS = {
    "qkv": {"norm": True},
    "o": {"residual": True},
    "gate_up": {"norm": True},
    "down": {"silu": True, "residual": True},
}


class Report:
    """A benchmark's output: a header naming the device, the versions and the measured copy bandwidth (every
    roofline's denominator), then one printed line per measurement, kept with its fields for `<out>/<name>.json`."""

    def __init__(self, name: str, out: Path | None) -> None:
        self.name, self.out = name, out
        self.device = torch.cuda.get_device_name()
        self.bandwidth = copy_bandwidth(torch.device("cuda"))
        self.rows: list[dict] = []
        self.say(
            f"{name}: {self.device}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
            f"triton {triton.__version__}; copy bandwidth {self.bandwidth / 1e12:.3f} TB/s (the roofline's)"
        )

    def say(self, line: str, **fields) -> None:
        print(line, flush=True)
        if fields:
            self.rows.append(fields)

    def read_ms(self, nbytes: float) -> float:
        """The time to read `nbytes` once at the measured copy bandwidth: the memory roofline."""
        return nbytes / self.bandwidth * 1e3

    def write(self) -> None:
        if self.out is None:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        info = {"device": self.device, "torch": torch.__version__, "cuda": torch.version.cuda,
                "triton": triton.__version__, "copy_bandwidth": self.bandwidth}  # fmt: skip
        path = self.out / f"{self.name}.json"
        path.write_text(json.dumps({**info, "rows": self.rows}, indent=1, default=str))
        print(f"wrote {path}")


def run_parts(description: str, parts: dict[str, Callable[[Report], None]], name: str) -> None:
    """The command line of a benchmark made of named parts: `--parts a,b` (all by default) and `--out DIR`."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--parts", default=",".join(parts), help=f"comma-separated, of: {', '.join(parts)}")
    parser.add_argument("--out", type=Path, default=None, help=f"write {name}.json there")
    args = parser.parse_args()
    chosen = args.parts.split(",")
    if unknown := [p for p in chosen if p not in parts]:
        sys.exit(f"unknown parts {unknown}; choose from {list(parts)}")
    report = Report(name, args.out)
    for part in chosen:
        parts[part](report)
        gc.collect()  # runners and their CUDA graphs reference each other: free them before the next part
        torch.cuda.empty_cache()
        report.write()


def on_every_rank(target: Callable[..., None], world: int) -> object:
    """Run `target(rank, world, init_method, results)` in one spawned process per GPU: what rank 0 puts."""
    import torch.multiprocessing as mp

    from hsmc.engine.ranks import local_init_method

    context = mp.get_context("spawn")
    results = context.Queue()
    init = local_init_method()
    procs = [context.Process(target=target, args=(r, world, init, results)) for r in range(world)]
    for p in procs:
        p.start()
    got = results.get(timeout=600)
    for p in procs:
        p.join()
    return got


def capture(fn: Callable[[], object], calls: int = 1) -> torch.cuda.CUDAGraph:
    """`calls` calls of fn captured in one CUDA graph (after a warm-up call on a side stream)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph


def graph_ms(fn: Callable[[], object]) -> float:
    """Median time of one replay of fn captured in a CUDA graph."""
    return triton.testing.do_bench(capture(fn).replay, return_mode="median", warmup=25, rep=100)


def layer_dims(shape: str, tp: int = 1) -> dict[str, tuple[int, int]]:
    """(N, K) of each decoder-layer Linear of a named shape, on one of `tp` tensor-parallel ranks (qkv and gate_up
    split their outputs, o and down their inputs)."""
    cfg = hf_config(shape)
    h, i = cfg.hidden_size, cfg.intermediate_size
    hd = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * hd // tp, cfg.num_key_value_heads * hd // tp
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * i // tp, h), "down": (h, i // tp)}


def layer_linears(shape: str, fp8: bool, layers: int | None = None, tp: int = 1) -> list[dict]:
    """Random weights of a shape's decoder layers (one rank's shards at `tp`): per Linear (weight, None) in bf16
    [N, K], or (e4m3 weight, block scales) with `fp8`; `norm1` / `norm2` the RMSNorm weights before qkv / gate_up."""
    from hsmc.ops.fp8_linear import QWEN_BLOCK, quantize_fp8

    cfg = hf_config(shape)
    out = []
    for _ in range(layers or cfg.num_hidden_layers):
        layer: dict = {}
        for name, (n, k) in layer_dims(shape, tp).items():
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
            layer[name] = quantize_fp8(w, QWEN_BLOCK) if fp8 else (w, None)
        layer["norm1"] = torch.rand(cfg.hidden_size, device="cuda", dtype=torch.bfloat16) + 0.5
        layer["norm2"] = torch.rand(cfg.hidden_size, device="cuda", dtype=torch.bfloat16) + 0.5
        out.append(layer)
    return out


def weight_read_bytes(layers: list[dict], kinds) -> int:
    """Bytes of the listed Linears' weights (and FP8 block scales) over all layers."""
    total = 0
    for layer in layers:
        for kind in kinds:
            w, s = layer[kind]
            total += w.numel() * w.element_size() + (0 if s is None else s.numel() * s.element_size())
    return total


def few_row_chain(layers: list[dict], x: torch.Tensor, path: str, plans: dict | None = None) -> torch.Tensor:
    """A decoder's bf16 Linears at a few rows without attention (o reads the first columns of qkv): `cublas` (norm /
    SiLU kernels, then cuBLAS with the residual as its beta term) or `few` (the few-row kernels, norm / SiLU fused,
    with `plans` per Linear kind or the planner's)."""
    import torch.nn.functional as F

    from hsmc.ops import fused
    from hsmc.ops.few_row_linear import few_row_linear

    plans = plans or {}
    q = layers[0]["o"][0].shape[1]
    stream = x
    for layer in layers:
        if path == "cublas":
            qkv = F.linear(fused.rms_norm(stream, layer["norm1"], 1e-6), layer["qkv"][0])
            stream = torch.addmm(stream, qkv[:, :q], layer["o"][0].t())
            gu = F.linear(fused.rms_norm(stream, layer["norm2"], 1e-6), layer["gate_up"][0])
            stream = torch.addmm(stream, fused.silu_mul(gu), layer["down"][0].t())
        else:
            qkv = few_row_linear(stream, layer["qkv"][0], norm=(layer["norm1"], 1e-6), plan=plans.get("qkv"))
            stream = few_row_linear(qkv[:, :q], layer["o"][0], residual=stream, plan=plans.get("o"))
            gu = few_row_linear(stream, layer["gate_up"][0], norm=(layer["norm2"], 1e-6), plan=plans.get("gate_up"))
            stream = few_row_linear(gu, layer["down"][0], silu_mul=True, residual=stream, plan=plans.get("down"))
    return stream


def time_8b_steps(
    row_counts: tuple[int, ...], variants: tuple[str, ...], use: Callable[[str], None], rounds: int
) -> dict[int, dict[str, float]]:
    """ms of one whole Qwen3-8B decode step (random bf16, graph replay, 260 keys per row) per row count and variant;
    `use(variant)` sets the route before the graphs are captured again; variants interleaved over `rounds` (a clock
    drift hits all alike), the median kept; "weight_read_ms" is the roofline of a step."""
    from hsmc.bench import timed
    from hsmc.engine.kv_pool import BlockTables, SlotAllocator
    from hsmc.engine.runner import ModelRunner
    from hsmc.models.config import DecoderConfig
    from hsmc.models.shapes import random_model
    from hsmc.models.size import weight_bytes
    from hsmc.ops.triton_backend import TritonBackend

    cfg = DecoderConfig.from_hf(hf_config("qwen3-8b"))
    context, width = 260, 300
    tables = BlockTables(SlotAllocator(max(row_counts) * width, "cuda"), max(row_counts), width)
    model = random_model(cfg, torch.bfloat16, "cuda")
    runner = ModelRunner(model, tables, TritonBackend(), cfg.num_layers, cuda_graphs=True)
    read_ms = weight_bytes(model) / copy_bandwidth(torch.device("cuda")) * 1e3
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
                runner.graphs.captured.clear()  # recaptured with this variant
                tokens = torch.randint(0, 1000, (m, 1), device="cuda")
                back = torch.full_like(rows, context)
                with torch.inference_mode():
                    step = lambda: runner.forward(runner.new_tokens(rows, tokens, one, context + 1), True)  # noqa: E731
                    step()
                    tables.truncate(rows, back, 1)
                    ms = timed(lambda: [(step(), tables.truncate(rows, back, 1)) for _ in range(50)]) / 50 * 1e3
                samples.setdefault(name, []).append(ms)
        times[m] = {"weight_read_ms": read_ms} | {name: sorted(v)[len(v) // 2] for name, v in samples.items()}
    return times


def full_batch(rows: int, tokens: int, context: int) -> tuple[ForwardBatch, int]:
    """`rows` rows of `tokens` new tokens each at `context` keys, over a shuffled block table; (batch, slots)."""
    slots = (rows + 1) * (context + 10) + 7
    table = torch.randperm(slots, device="cuda")[: (rows + 1) * (context + 1)].view(rows + 1, -1)
    row_ids = torch.arange(rows, device="cuda")
    start = torch.full((rows,), context - tokens, device="cuda")
    num_new = torch.full((rows,), tokens, device="cuda")
    cols = padded_columns(start, num_new, tokens)
    write = table[row_ids[:, None], cols]
    zeros = torch.zeros(rows, tokens, dtype=torch.int64, device="cuda")
    return ForwardBatch(row_ids, table, zeros, cols, write, start, num_new, context), slots


class AttentionCase:
    """One (query heads, rows, tokens, keys) case: its batch, random K/V and queries."""

    def __init__(self, heads: int, rows: int, tokens: int, context: int) -> None:
        self.heads, self.rows, self.tokens, self.context = heads, rows, tokens, context
        self.batch, slots = full_batch(rows, tokens, context)
        self.cache = KVCache(1, slots, KV_HEADS, HEAD_DIM, torch.bfloat16, "cuda")
        self.cache.data.normal_()
        self.q = torch.randn(rows, tokens, heads, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        self.sms = torch.cuda.get_device_properties(0).multi_processor_count

    @property
    def kv_bytes(self) -> int:
        return self.rows * self.context * KV_HEADS * HEAD_DIM * 2 * 2

    def planned(self) -> AttentionPlan:
        return plan_attention(self.rows, self.tokens, self.context, self.heads, KV_HEADS, self.sms)

    def attend(self, plan: AttentionPlan) -> torch.Tensor:
        b, keys, values = self.batch, self.cache.keys(0), self.cache.values(0)
        return paged_attention(self.q, keys, values, b.table, b.rows, b.start, b.num_new, plan)

    def us_per_call(self, plan: AttentionPlan) -> float:
        """16 calls replayed in one graph (a Python launch would take longer than the kernel)."""
        return graph_ms(lambda: [self.attend(plan) for _ in range(16)]) / 16 * 1e3


class ParticleCase:
    """`requests` runs of `run` rows (SMC particles) over one prompt of `prompt` columns each, then `own` columns per
    row, `tokens` new tokens a row: the batch, random K/V and queries, and the run's shared columns."""

    def __init__(self, heads: int, requests: int, run: int, tokens: int, prompt: int, own: int) -> None:
        self.heads, self.run, self.tokens, self.context = heads, run, tokens, prompt + own
        self.rows = rows = requests * run
        slots = requests * prompt + rows * own + 1
        perm = torch.randperm(slots - 1, device="cuda")
        prompts = perm[: requests * prompt].view(requests, 1, prompt).expand(requests, run, prompt)
        table = torch.cat([prompts.reshape(rows, prompt), perm[requests * prompt :].view(rows, own)], 1)
        table = torch.cat([table, torch.full((1, prompt + own), slots - 1, device="cuda")])
        row_ids = torch.arange(rows, device="cuda")
        start = torch.full((rows,), prompt + own - tokens, device="cuda")
        num_new = torch.full((rows,), tokens, device="cuda")
        cols = padded_columns(start, num_new, tokens)
        zeros = torch.zeros(rows, tokens, dtype=torch.int64, device="cuda")
        self.batch = ForwardBatch(
            row_ids, table, zeros, cols, table[row_ids[:, None], cols], start, num_new, prompt + own
        )
        self.cache = KVCache(1, slots, KV_HEADS, HEAD_DIM, torch.bfloat16, "cuda")
        self.cache.data.normal_()
        self.q = torch.randn(rows, tokens, heads, HEAD_DIM, dtype=torch.bfloat16, device="cuda")
        self.sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.unique_kv_bytes = (requests * prompt + rows * own) * KV_HEADS * HEAD_DIM * 2 * 2

    def planned(self, by_run: bool) -> AttentionPlan:
        run = self.run if by_run else 1
        return plan_attention(self.rows, self.tokens, self.context, self.heads, KV_HEADS, self.sms, run=run)

    def shared(self) -> torch.Tensor:
        b = self.batch
        return shared_columns(b.table, b.rows, b.start, b.num_new, self.run)

    def attend(self, plan: AttentionPlan, shared: torch.Tensor | None = None) -> torch.Tensor:
        """With a shared-prefix plan and no `shared`, the shared columns are found in the call (once per forward in
        the engine, so this counts them once per layer)."""
        b, keys, values = self.batch, self.cache.keys(0), self.cache.values(0)
        if plan.shared is not None and shared is None:
            shared = self.shared()
        return paged_attention(self.q, keys, values, b.table, b.rows, b.start, b.num_new, plan, None, shared)

    def us_per_call(self, plan: AttentionPlan, shared: torch.Tensor | None = None) -> float:
        """16 calls replayed in one graph."""
        return graph_ms(lambda: [self.attend(plan, shared) for _ in range(16)]) / 16 * 1e3
