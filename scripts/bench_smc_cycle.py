"""The stacks' units of work on the real shapes (random bf16 weights) against their weight-read bound, with the
eager unit measured in the same run as the baseline:

rounds        rejection rounds captured as CUDA graphs: configs/bench/eagle3_8b.yaml at 1/4/16 requests, graphed
              against eager rounds.
cycles        SMC cycles captured as CUDA graphs: configs/bench/{smc,hierarchical}_8b_32b.yaml (and smc at N=6 K=16)
              at 1/4/16 requests, graphed against eager cycles (`bench_stack` times both), and the cycle graphs'
              memory pool against the eager cycles' peak and the KV reserve's estimate.
cycle-kernels one request through configs/bench/smc_8b_32b.yaml (N=8 K=8, N=6 K=16): the kernels of a graphed cycle
              by kind (torch.profiler), how many run outside the forwards, and the GPU's idle time.

The SMC target is the 32B shape where the GPU holds it beside the 8B (>= 120 GB: H200), else the 14B (H100).

    python scripts/bench_smc_cycle.py [--parts rounds,cycles,cycle-kernels] [--out DIR]

Tokens per second of whole stacks: `hsmc bench --config configs/bench/<stack>.yaml`.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path

import torch
from gpu_common import Report, run_parts

from hsmc.bench import bench_stack, config_for_bench, format_stack_table, to_json
from hsmc.config import load_config
from hsmc.decoder import HierarchicalDecoder

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "bench"
BATCHES = [1, 4, 16]
KERNEL_KINDS = (("_few_row", "few-row Linears"), ("nvjet", "cuBLAS GEMMs"), ("splitKreduce", "cuBLAS GEMMs"),
                ("_attention", "attention"), ("_combine", "attention"), ("_rms_norm", "RMSNorms"),
                ("_qkv_rope", "q/k norm + RoPE + KV"), ("_silu", "SiLU·mul"), ("_sum_splits", "split-K sums"),
                ("_decode_linear", "one-row Linears"), ("_lse_", "vocab reductions"),
                ("_gumbel_", "vocab reductions"))  # fmt: skip


def smc_target() -> str:
    """The SMC target of the bench configs on this GPU: the 32B shape where it fits beside the 8B, else the 14B."""
    memory = torch.cuda.get_device_properties(0).total_memory / 1e9
    return "random:qwen3-32b" if memory >= 120 else "random:qwen3-14b"


def smc_config(name: str, smc_overrides: list[str]):
    path = CONFIGS / f"{name}.yaml"
    top = len(load_config(path).levels) - 1
    return load_config(path, [f"levels.{top}.model={smc_target()}", *(f"levels.{top}.{o}" for o in smc_overrides)])


def free() -> None:
    gc.collect()  # runners and their CUDA graphs reference each other
    torch.cuda.empty_cache()


def rounds(report: Report) -> None:
    report.say("== graphed vs eager rejection rounds: configs/bench/eagle3_8b.yaml, 64-token prompts, 128 new ==")
    config = load_config(CONFIGS / "eagle3_8b.yaml")
    decoder = HierarchicalDecoder(config_for_bench(config, BATCHES, 64, 128))
    graphed = bench_stack("eagle3_8b graphed", decoder, BATCHES, 64, 128, report.bandwidth)
    rejection = next(level for level in decoder.stack.levels if getattr(level, "rounds", None) is not None)
    rejection.rounds = None  # the same stack with its rounds eager (decode graphs kept)
    eager = bench_stack("eagle3_8b eager", decoder, BATCHES, 64, 128, report.bandwidth)
    report.say(format_stack_table(graphed + eager))
    for g, e in zip(graphed, eager):
        report.say(f"eagle3_8b, {g.batch} requests: graphed rounds {g.tok_s_total:.1f} tok/s, eager rounds "
                   f"{e.tok_s_total:.1f} ({g.tok_s_total / e.tok_s_total:.2f}x); round {g.step_ms:.2f} ms vs eager "
                   f"{e.step_ms:.2f} ms, bound {g.bound_step_ms:.2f} ms ({g.step_ms / g.bound_step_ms:.2f}x)",
                   graphed=json.loads(to_json([g]))[0], eager=json.loads(to_json([e]))[0])  # fmt: skip
    del decoder, rejection
    free()


def pool_bytes(pool) -> int:
    """Bytes of the CUDA caching allocator's segments in a graph memory pool."""
    return sum(s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) == tuple(pool))


def cycles(report: Report) -> None:
    from hsmc.engine.kv_sizing import LOGIT_COPIES

    report.say(f"== graphed vs eager SMC cycles, target {smc_target()}, 64-token prompts, 128 new ==")
    cases = [("smc_8b_32b", [], BATCHES), ("smc_8b_32b", ["particles=6", "block_size=16"], [1]),
             ("hierarchical_8b_32b", [], BATCHES)]  # fmt: skip
    for name, smc_overrides, batches in cases:
        label = " ".join([name, *smc_overrides])
        decoder = HierarchicalDecoder(config_for_bench(smc_config(name, smc_overrides), batches, 64, 128))
        rows = bench_stack(label, decoder, batches, 64, 128, report.bandwidth)
        report.say(format_stack_table(rows))
        for r in rows:
            report.say(f"{label}, {r.batch} requests: graphed cycles {r.tok_s_request:.1f} tok/s/req, eager cycles "
                       f"{r.eager_cycles_tok_s_request:.1f} ({r.tok_s_request / r.eager_cycles_tok_s_request:.2f}x); "
                       f"cycle {r.step_ms:.2f} ms, bound {r.bound_step_ms:.2f} ms ({r.of_bound:.2f}x)",
                       **json.loads(to_json([r]))[0])  # fmt: skip
        smc = decoder.stack.top
        rows_max, width = max(batches) * smc.params.particles, smc.params.block_size + 1
        estimate = LOGIT_COPIES * rows_max * width * smc.state.runner.module.config.vocab_size * 4
        used = pool_bytes(smc.cycle_graphs.scope.pool)  # every graph of the stack
        smc.replay_cycles = False  # the eager cycles' peak, for the same requests
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        decoder.generate([[7] * 64 for _ in range(max(batches))], max_new_tokens=48, ignore_eos=True)
        eager_peak = torch.cuda.max_memory_allocated() - base
        smc.replay_cycles = True
        shapes = len(smc.cycle_graphs.captured)
        report.say(f"{label}: the stack's graph pool {used / 2**30:.2f} GiB, {shapes} cycle shapes; "
                   f"eager cycles' peak above the resident memory {eager_peak / 2**30:.2f} GiB; the KV reserve's "
                   f"logits term for {rows_max} rows x {width}: {estimate / 2**30:.2f} GiB",
                   stack=label, pool_bytes=used, eager_peak=eager_peak, reserve_term=estimate)  # fmt: skip
        del decoder, smc
        free()


def cycle_kernels(report: Report) -> None:
    """Kernels inside graphs are traced one by one (CUPTI); under PDL a kernel's time includes its wait."""
    from torch.profiler import ProfilerActivity, profile

    report.say("== kernels per graphed SMC cycle, one 64-token request, 128 new (torch.profiler) ==")
    for overrides in ([], ["particles=6", "block_size=16"]):
        label = " ".join(["smc_8b_32b", *overrides])
        decoder = HierarchicalDecoder(config_for_bench(smc_config("smc_8b_32b", overrides), [1], 64, 128))
        ids = [list(range(100, 164))]
        for _ in range(2):
            decoder.generate(ids, max_new_tokens=128, ignore_eos=True)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            decoder.generate(ids, max_new_tokens=128, ignore_eos=True)
            torch.cuda.synchronize()
        replays = max(decoder.stack.top.cycle_graphs.replays, 1)
        kernels = sorted(
            (e.time_range.start, e.time_range.end, e.name)
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0
        )
        by_kind: dict[str, list[float]] = {}
        for start, end, name in kernels:
            kind = next((k for key, k in KERNEL_KINDS if key in name), "outside the forwards")
            by_kind.setdefault(kind, [0.0, 0.0])
            by_kind[kind][0] += (end - start) / replays
            by_kind[kind][1] += 1 / replays
        busy, reach = 0.0, kernels[0][0]
        for start, end, _ in kernels:
            busy += max(0.0, end - max(start, reach))
            reach = max(reach, end)
        window = reach - kernels[0][0]
        report.say(f"{label}: {replays} graphed cycles; GPU idle {(window - busy) / 1e3:.2f} ms of {window / 1e3:.1f} "
                   f"ms (the prefill's launches included); per cycle, kernel time summed:",
                   stack=label, cycles=replays, idle_us=window - busy, by_kind=by_kind)  # fmt: skip
        for kind, (us, n) in sorted(by_kind.items(), key=lambda kv: -kv[1][0]):
            report.say(f"  {kind:<24}{us / 1e3:8.3f} ms {n:8.1f} kernels")
        del decoder
        free()


if __name__ == "__main__":
    parts = {"rounds": rounds, "cycles": cycles, "cycle-kernels": cycle_kernels}
    run_parts(__doc__.split("\n\n")[0], parts, "bench_smc_cycle")
