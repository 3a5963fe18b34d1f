"""Tensor parallelism on the GPUs of one host (random weights of the Qwen3 shapes), every number beside its TP=1
baseline from the same run:

all-reduce  one all-reduce of R rows of the 32B's activation (5120 bf16) inside a CUDA graph: NCCL, torch's
            symmetric-memory one-shot kernel and hsmc's push kernel (`hsmc.ops.push_all_reduce`, what the models
            run up to `SymmetricAllReduce.MAX_BYTES`), and whether they give NCCL's bits.
control     the host's share: rank 0's message that opens every driver turn, and the step of a 0.6B decode.
decode      batch-1 decode of Qwen3-8B and Qwen3-32B (bf16) at TP=1, 2, ... N (`hsmc bench --shape`), against the
            per-GPU weight-read roofline, with the all-reduces' share of a step (their count x the one-shot time).
smc         SMC-SD 8B -> 32B (N=8, K=8) and the hierarchical stack (EAGLE3 head -> 8B -> 32B) at TP=1, 2, ... N.
            Both do not fit one 80 GB GPU with the 32B whole, so both runs keep the 32B's first `--target-layers`
            layers.
headline    the hierarchical stack with the whole 32B at TP=N, and each GPU's peak memory (nvidia-smi).
rank-share  one GPU suffices: what one rank computes at TP=2 and 4, with communication free. Random models of a
            rank's shard shapes (heads, KV heads, MLP and LM-head vocabulary divided by N; `<shape>-rank-of-N`)
            run as TP=1 stacks beside the whole shapes: their ratio bounds what TP=N reaches with these kernels,
            and the real TP=N run's distance from it is what the all-reduces and the logits' all-gather cost. An
            EAGLE3 head takes its 8B's shard shape here (in a TP run it stays whole): its share is a little low.
host-profile where each rank's host time goes in a 0.6B decode at TP=1 and TP=N (host-bound: its step is the
            host's): py-spy samples every process of the run; per process, the functions holding the most samples
            inside the request loop, and the raw stacks gzipped under --out (py-spy on PATH, or beside python).

    python scripts/bench_tensor_parallel.py [--parts all-reduce,control,decode,smc,headline,host-profile,rank-share]
                                            [--out DIR]

Each `hsmc bench` case runs in its own process, so one case's memory is gone before the next loads.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import torch
import torch.multiprocessing as mp
from gpu_common import Report, capture, on_every_rank, run_parts

ROWS = (1, 8, 64, 72, 128, 512, 2048)  # decode, SMC particles, an SMC verify (8 x 9), prefill chunks
HIDDEN = 5120  # Qwen3-32B
TARGET_LAYERS = 40  # of the 32B's 64, so that the 8B and the 32B fit one 80 GB GPU for the TP=1 baseline
WORLD = torch.cuda.device_count()
SIZES = tuple(n for n in (1, 2, 4, 8) if n <= WORLD)  # every TP size this host can run, TP=1 the baseline
ONE_ROW_US: list[float] = []  # the all-reduce of one row, as the model runs it (measured by all_reduce)
SMI = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]


def _all_reduce_rank(rank: int, world: int, init_method: str, results: mp.Queue) -> None:
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    from hsmc.engine.ranks import join

    ranks = join(rank, world, init_method, "cuda")
    push, group = ranks.tp.symmetric, dist.group.WORLD.group_name
    staging = symm_mem.empty(max(ROWS) * HIDDEN, dtype=torch.bfloat16, device="cuda")
    symm_mem.rendezvous(staging, group)

    def one_shot(x: torch.Tensor) -> torch.Tensor:  # torch's: copy, barrier, read the peers, barrier
        out = torch.empty_like(x)
        view = staging[: x.numel()].view_as(x)
        return torch.ops.symm_mem.one_shot_all_reduce_copy_out(view, x, "sum", group, out)

    rows_out = []
    for rows in ROWS:
        g = torch.Generator(device="cuda").manual_seed(rank * 1000 + rows)
        x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)
        nccl = x.clone()
        dist.all_reduce(nccl)
        row = {"rows": rows, "bytes": x.numel() * 2, "one_shot_equal": bool(torch.equal(one_shot(x), nccl))}
        if push is not None and push.takes(x):
            row["push_equal"] = bool(torch.equal(push(x), nccl))
            row["push"] = _graph_us(lambda x=x: push(x))
        row["one_shot"] = _graph_us(lambda x=x: one_shot(x))
        row["nccl"] = _graph_us(lambda x=x: dist.all_reduce(x))  # last: it sums x into itself
        rows_out.append(row)
    if rank == 0:
        results.put(rows_out)
    ranks.leave()


def _graph_us(fn, calls: int = 20, replays: int = 50) -> float:
    """Microseconds per call of `fn`, `calls` of them captured in one CUDA graph (every rank replays in step)."""
    import torch.distributed as dist

    graph = capture(fn, calls)
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / (calls * replays)


def all_reduce(report: Report) -> None:
    report.say(f"== all-reduce of R x {HIDDEN} bf16 in a CUDA graph, {WORLD} GPUs: NCCL against one-shot ==")
    rows = on_every_rank(_all_reduce_rank, WORLD)
    for r in rows:
        push = "(NCCL: over MAX_BYTES)"
        if "push" in r:
            push = f"{r['push']:6.1f} us ({r['nccl'] / r['push']:.2f}x), same bits as NCCL: {r['push_equal']}"
        report.say(f"R={r['rows']:5d} ({r['bytes'] / 1024:6.0f} KiB): NCCL {r['nccl']:6.1f} us, torch one-shot "
                   f"{r['one_shot']:6.1f} us (same bits: {r['one_shot_equal']}), hsmc push {push}",
                   part="all-reduce", world=WORLD, **r)  # fmt: skip
    ONE_ROW_US.append(rows[0].get("push", rows[0]["nccl"]))


def _control_rank(rank: int, world: int, init_method: str, results: mp.Queue) -> None:
    from hsmc.engine.driver import Turn
    from hsmc.engine.ranks import join

    ranks = join(rank, world, init_method, "cuda")
    empty = Turn([], [], None)
    for _ in range(50):
        ranks.broadcast(empty if rank == 0 else None)
    start = time.perf_counter()
    for _ in range(1000):
        ranks.broadcast(empty if rank == 0 else None)
    if rank == 0:
        results.put((time.perf_counter() - start) * 1e3)
    ranks.leave()


def control(report: Report) -> None:
    """What every driver turn costs on the host under TP: rank 0's message of the turn's inputs (`ControlChannel`),
    and a 1-row decode of the 0.6B shape, whose weights take ~0.3 ms to read: its step is the host's time per step."""
    us = on_every_rank(_control_rank, WORLD)
    report.say(f"broadcast of an empty turn to {WORLD - 1} follower(s): {us:.0f} us", part="control", broadcast_us=us)
    for tp in (1, WORLD):
        row = _hsmc_bench(["--shape", "qwen3-0.6b", "--batch", "1", "--new-tokens", "256", "--no-baseline",
                           "--tensor-parallel", str(tp)])[0]  # fmt: skip
        report.say(f"qwen3-0.6b TP={tp}: {row['hsmc_tok_s']:.1f} tok/s ({1e3 / row['hsmc_tok_s']:.2f} ms a step)",
                   part="control", tp=tp, tok_s=row["hsmc_tok_s"])  # fmt: skip


def _hsmc_bench(args: list[str], first: str = "") -> list[dict]:
    """One `hsmc bench ... --json` in its own process (`first`: Python it runs before): its rows."""
    cmd = [sys.executable, "-c", f"import sys; {first}from hsmc.cli import main; sys.exit(main())", "bench", *args,
           "--json"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
    if done.returncode:
        raise RuntimeError(f"{' '.join(args)} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def decode(report: Report) -> None:
    all_reduce_us = ONE_ROW_US[0] if ONE_ROW_US else None
    report.say(f"== batch-1 decode, bf16, TP={SIZES} (roofline: one GPU's weight shard read once) ==")
    for shape, layers in (("qwen3-8b", 36), ("qwen3-32b", 64)):
        base = None
        for tp in SIZES:
            row = _hsmc_bench(["--shape", shape, "--batch", "1", "--new-tokens", "256", "--no-baseline",
                               "--tensor-parallel", str(tp)])[0]  # fmt: skip
            tok_s = row["hsmc_tok_s"]
            base = base or tok_s
            share = ""
            if tp > 1 and all_reduce_us is not None:
                share = f", all-reduces {(2 * layers + 1) * all_reduce_us / 1e3 * tok_s / 1e3:.0%} of a step"
            report.say(f"{shape} TP={tp}: {tok_s:7.1f} tok/s, {tok_s / base:.2f}x TP=1, "
                       f"{row['of_roofline']:.1%} of its roofline ({row['roofline_tok_s']:.0f} tok/s){share}",
                       part="decode", shape=shape, tp=tp, tok_s=tok_s, vs_tp1=tok_s / base,
                       of_roofline=row["of_roofline"])  # fmt: skip


def smc(report: Report) -> None:
    report.say(f"== SMC cycles, bf16, 32B cut to {TARGET_LAYERS} layers, 1 request: TP={SIZES} ==")
    for config, target in (("smc_8b_32b", 1), ("hierarchical_8b_32b", 2)):
        base = None
        for tp in SIZES:
            cut = f"levels.{target}.num_layers={TARGET_LAYERS}"
            row = _hsmc_bench(["--config", f"configs/bench/{config}.yaml", "--batch", "1", "--new-tokens", "128",
                               cut, f"engine.tensor_parallel={tp}"])[0]  # fmt: skip
            cycle, tok_s = row["step_ms"], row["tok_s_request"]
            base = base or cycle
            report.say(f"{config} TP={tp}: cycle {cycle:.2f} ms ({cycle / base:.2f}x TP=1), {tok_s:.1f} tok/s",
                       part="smc", config=config, tp=tp, cycle_ms=cycle, vs_tp1=cycle / base, tok_s=tok_s)  # fmt: skip


def headline(report: Report) -> None:
    report.say(f"== hierarchical 8B -> 32B (whole), bf16, TP={WORLD}: end to end and each GPU's peak memory ==")
    peaks = [0] * WORLD
    running = True

    def watch() -> None:
        while running:
            used = subprocess.run(SMI, capture_output=True, text=True).stdout.split()
            for i, mib in enumerate(used[:WORLD]):
                peaks[i] = max(peaks[i], int(mib))
            time.sleep(0.2)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        rows = _hsmc_bench(["--config", "configs/bench/hierarchical_8b_32b.yaml", "--batch", "1,4", "--new-tokens",
                            "128", f"engine.tensor_parallel={WORLD}"])  # fmt: skip
    finally:
        running = False
        watcher.join()
    for row in rows:
        cycle, tok_s = row["step_ms"], row["tok_s_request"]
        report.say(f"{row['batch']} request(s): cycle {cycle:.2f} ms, {tok_s:.1f} tok/s per request",
                   part="headline", batch=row["batch"], cycle_ms=cycle, tok_s=tok_s)  # fmt: skip
    report.say("peak memory per GPU (nvidia-smi, MiB): " + ", ".join(map(str, peaks)), part="headline-memory",
               peak_mib=peaks)  # fmt: skip


def add_rank_shapes(worlds: tuple[int, ...] = (2, 4)) -> None:
    """Name, in this process, the shard one of N ranks holds of each Qwen3 shape `<shape>-rank-of-N`, for
    `random:` sources (the end-of-text token moved inside the smaller vocabulary)."""
    from hsmc.models.shapes import SHAPES

    for name in ("qwen3-8b", "qwen3-32b"):
        whole = SHAPES[name]
        for n in worlds:
            vocab = -(-whole["vocab_size"] // n)
            SHAPES[f"{name}-rank-of-{n}"] = dict(
                whole, num_attention_heads=whole["num_attention_heads"] // n,
                num_key_value_heads=whole["num_key_value_heads"] // n,
                intermediate_size=whole["intermediate_size"] // n, vocab_size=vocab, eos_token_id=vocab - 1,
            )  # fmt: skip


def rank_share(report: Report) -> None:
    first = "sys.path.insert(0, 'scripts'); from bench_tensor_parallel import add_rank_shapes; add_rank_shapes(); "
    report.say("== one rank's share of TP=N with free communication, on one GPU (bf16; the SMC cycles with the 32B "
               f"cut to {TARGET_LAYERS} layers): shard shapes as TP=1 stacks against the whole shapes ==")  # fmt: skip
    base: dict[str, float] = {}
    for n in (1, 2, 4):
        suffix = f"-rank-of-{n}" if n > 1 else ""
        for shape, batch in (("qwen3-8b", "1"), ("qwen3-8b", "8"), ("qwen3-32b", "1")):
            row = _hsmc_bench(["--shape", shape + suffix, "--batch", batch, "--new-tokens", "128", "--no-baseline"],
                              first)[0]  # fmt: skip
            case = f"{shape} batch {batch}"
            base.setdefault(case, row["hsmc_tok_s"])
            report.say(f"{case}, 1/{n} of it: {row['hsmc_tok_s']:7.1f} tok/s, {row['hsmc_tok_s'] / base[case]:.2f}x "
                       f"the whole, {row['of_roofline']:.1%} of its roofline", part="rank-share", case=case,
                       world=n, tok_s=row["hsmc_tok_s"], of_roofline=row["of_roofline"])  # fmt: skip
        for config, target in (("smc_8b_32b", 1), ("hierarchical_8b_32b", 2)):  # an EAGLE3 head: shaped as its 8B
            models = [f"levels.{i}.model=random:qwen3-8b{suffix}" for i in range(target)]
            row = _hsmc_bench(["--config", f"configs/bench/{config}.yaml", "--batch", "1", "--new-tokens", "128",
                               *models, f"levels.{target}.model=random:qwen3-32b{suffix}",
                               f"levels.{target}.num_layers={TARGET_LAYERS}"], first)[0]  # fmt: skip
            base.setdefault(config, row["step_ms"])
            report.say(f"{config} cycle, 1/{n} of it: {row['step_ms']:.2f} ms ({row['step_ms'] / base[config]:.3f}x "
                       "the whole)", part="rank-share", case=config, world=n, cycle_ms=row["step_ms"])  # fmt: skip


def host_profile(report: Report) -> None:
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if spy is None:
        report.say("host-profile: py-spy is not installed (pip install py-spy)", part="host-profile")
        return
    for tp in (1, WORLD):
        raw = Path(tempfile.mkdtemp()) / f"host-profile-tp{tp}.txt"
        bench = ["bench", "--shape", "qwen3-0.6b", "--batch", "1", "--new-tokens", "4096", "--no-baseline",
                 "--tensor-parallel", str(tp)]  # fmt: skip
        cmd = [spy, "record", "--subprocesses", "--format", "raw", "--rate", "200", "--output", str(raw), "--",
               sys.executable, "-c", "import sys; from hsmc.cli import main; sys.exit(main())", *bench]  # fmt: skip
        subprocess.run(cmd, capture_output=True, text=True, env=os.environ, check=True)
        for process, top, total in _hottest(raw.read_text().splitlines()):
            report.say(f"TP={tp} {process}: {total} samples in the request loop; most self time in: "
                       + "; ".join(f"{name} {count / total:.0%}" for name, count in top),
                       part="host-profile", tp=tp, process=process, samples=total, top=top)  # fmt: skip
        if report.out is not None:
            report.out.mkdir(parents=True, exist_ok=True)
            with raw.open("rb") as f, gzip.open(report.out / f"{raw.name}.gz", "wb") as g:
                shutil.copyfileobj(f, g)


LOOP = ("_run_turn", "RequestDriver.follow")  # frames of the request loop, on rank 0 and on a follower


def _hottest(lines: list[str], top: int = 12) -> list[tuple[str, list[tuple[str, int]], int]]:
    """py-spy's raw stacks (`process PID:"cmd";[process PID:"cmd";...]frame;...;frame count`, a child's after its
    parents') -> per process, the leaf frames with the most samples among stacks inside the request loop, and how
    many samples those stacks hold."""
    leaves: dict[str, Counter[str]] = {}
    for line in lines:
        parsed = re.fullmatch(r'((?:process \d+:".*?";)+)(.*) (\d+)', line)  # a command line may hold ';'
        if parsed is None:
            continue
        process = re.findall(r"process \d+", parsed[1])[-1]
        frames, count = parsed[2].split(";"), int(parsed[3])
        if any(loop in frame for frame in frames for loop in LOOP):
            leaves.setdefault(process, Counter())[frames[-1]] += count
    return [(p, c.most_common(top), sum(c.values())) for p, c in leaves.items()]


if __name__ == "__main__":
    parts = {"all-reduce": all_reduce, "control": control, "decode": decode, "smc": smc, "headline": headline,
             "host-profile": host_profile, "rank-share": rank_share}  # fmt: skip
    run_parts(__doc__, parts, "bench_tensor_parallel")
