"""FP8 weights (Qwen's 128 x 128 blocks) beyond one GEMM, against their weight-read bound:

linears  the FP8 decoder Linears at the row counts the headline stack runs (an SMC proposal's particles; a verify
         of rows x (K + 1) tokens), all layers of a kind chained in one graph: the weight-only route (norm / SiLU
         kernel, then the FP8 GEMM) and FP8 activations, against bf16 cuBLAS on the dequantized weights (baseline).
loading  a random 32B-shape FP8 checkpoint (~34 GB in 4 GB shards; the first 32 layers with less disk) streamed onto
         the GPU in a fresh process: peak CPU RSS growth against the largest shard (the loader's bound: 1.5x).

    python scripts/bench_fp8.py [--parts linears,loading] [--out DIR]

Single FP8 GEMMs against cuBLASLt and the tensor-core bound: scripts/bench_fp8_gemm.py. Batch-1 FP8 decode against
bf16 and the roofline: `hsmc bench --shape qwen3-8b,qwen3-32b --batch 1 --dtype fp8 --no-baseline`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from gpu_common import LINEAR_STEPS, Report, graph_ms, layer_linears, run_parts

from hsmc.ops import fused
from hsmc.ops.fp8_linear import QWEN_BLOCK, Fp8Linear, dequantize_fp8
from hsmc.ops.triton_backend import TritonBackend

ROOT = Path(__file__).resolve().parents[1]


def fp8_step(x, w, s, step: dict, norm, residual, dynamic: bool) -> torch.Tensor:
    """One FP8 Linear step over rows > 1 as the Triton backend runs it: norm / SiLU kernel, then the routed GEMM."""
    if step.get("norm"):
        x = fused.rms_norm(x, norm, 1e-6)
    elif step.get("silu"):
        x = fused.silu_mul(x)
    linear = Fp8Linear.of(w, s, QWEN_BLOCK, dynamic_activations=dynamic)
    return TritonBackend().linear(x, linear, residual if step.get("residual") else None)


def linears(report: Report) -> None:
    report.say("== FP8 Linears, all layers of a kind chained: weight-only / FP8 activations / bf16 cuBLAS ==")
    for shape, row_counts in (("qwen3-32b", (2, 8, 16, 72, 144, 256)), ("qwen3-8b", (8, 32, 72))):
        time_fp8_linears(report, shape, row_counts)
        torch.cuda.empty_cache()


def time_fp8_linears(report: Report, shape: str, row_counts: tuple[int, ...]) -> None:
    layers = layer_linears(shape, True)
    for m in row_counts:
        totals = {"weight-only": 0.0, "fp8 activations": 0.0, "bf16 cublas": 0.0}
        floor = 0.0
        for kind, step in LINEAR_STEPS.items():
            floor += report.read_ms(sum(lay[kind][0].numel() + lay[kind][1].numel() * 4 for lay in layers))
            for name, ms in time_fp8_kind(layers, kind, step, m).items():
                totals[name] += ms
        cells = ", ".join(f"{name} {ms:.3f} ms ({floor / ms:.0%})" for name, ms in totals.items())
        report.say(f"  {shape} M={m}: weight read {floor:.3f} ms; {cells}; fp8 activations / bf16 cuBLAS "
                   f"{totals['fp8 activations'] / totals['bf16 cublas']:.2f}x",
                   shape=shape, rows=m, weight_read_ms=floor, **totals)  # fmt: skip


def time_fp8_kind(layers: list[dict], kind: str, step: dict, m: int) -> dict[str, float]:
    """ms of one Linear kind over all layers at m rows, by route; bf16 cuBLAS on the dequantized weights."""
    n, k = layers[0][kind][0].shape
    x = torch.randn(m, 2 * k if step.get("silu") else k, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    norm = layers[0]["norm1"]
    times = {
        name: graph_ms(lambda d=dynamic: [fp8_step(x, *lay[kind], step, norm, res, d) for lay in layers])
        for name, dynamic in (("weight-only", False), ("fp8 activations", True))
    }
    dense = [dequantize_fp8(*lay[kind], QWEN_BLOCK, torch.bfloat16) for lay in layers]
    xin = x[:, :k].contiguous()
    times["bf16 cublas"] = graph_ms(lambda: [F.linear(xin, d) for d in dense])
    return times


RSS_MEASURE = """
import json, sys, time, torch
from hsmc.models.loading import load_model

def status(field):
    line = next(x for x in open("/proc/self/status") if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024

torch.zeros(1, device="cuda")  # the CUDA context and the imports before the measurement
load_model(sys.argv[1], "bfloat16", "cuda", num_layers=1)
torch.cuda.empty_cache()
with open("/proc/self/clear_refs", "w") as f:  # restart VmHWM from here
    f.write("5")
base = status("VmRSS")
began = time.perf_counter()
load_model(sys.argv[1], "bfloat16", "cuda")
print(json.dumps({"peak": status("VmHWM") - base, "seconds": time.perf_counter() - began}))
"""


def write_fp8_checkpoint(folder: Path, shape: str, layers: int, shard_bytes: int) -> list[int]:
    """A random checkpoint of `shape` (its first `layers` layers) in Qwen's FP8 layout, written shard by shard;
    returns the shard sizes."""
    from safetensors.torch import save_file

    from hsmc.models.config import DecoderConfig
    from hsmc.models.shapes import hf_config, random_model

    hf = hf_config(shape)
    hf.num_hidden_layers = min(layers, hf.num_hidden_layers)
    model = random_model(DecoderConfig.from_hf(hf), torch.bfloat16, "cuda", seed=3, fp8=True)
    folder.mkdir(parents=True)
    quant = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic", "fmt": "e4m3"}
    (folder / "config.json").write_text(json.dumps({**hf.to_dict(), "quantization_config": quant}))
    state = model.state_dict()
    del model
    shard, sizes, weight_map = {}, [], {}

    def flush() -> None:
        name = f"model-{len(sizes) + 1:05d}.safetensors"
        save_file(shard, folder / name)
        weight_map.update(dict.fromkeys(shard, name))
        sizes.append((folder / name).stat().st_size)
        shard.clear()

    for key in sorted(state):
        shard[key] = state.pop(key).contiguous().cpu()
        if sum(t.numel() * t.element_size() for t in shard.values()) >= shard_bytes:
            flush()
    if shard:
        flush()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return sizes


def loading(report: Report) -> None:
    report.say("== peak CPU RSS while streaming a 32B-shape FP8 checkpoint onto the GPU ==")
    root = Path(tempfile.mkdtemp())
    free = shutil.disk_usage(root).free
    layers = 64 if free > 40e9 else 32 if free > 22e9 else 0  # all 64 layers are ~34 GB; the shards are 4 GB either way
    if not layers:
        report.say(f"loading: {free / 1e9:.0f} GB free on {root}, at least 22 GB needed: skipped")
        return
    try:
        began = time.perf_counter()
        sizes = write_fp8_checkpoint(root / "ckpt", "qwen3-32b", layers, 4 * 10**9)
        written = time.perf_counter() - began
        torch.cuda.empty_cache()
        env = {**os.environ, "PYTHONPATH": str(ROOT), "MALLOC_MMAP_THRESHOLD_": "65536"}
        run = subprocess.run([sys.executable, "-c", RSS_MEASURE, str(root / "ckpt")], capture_output=True, text=True,
                             env=env)  # fmt: skip
        if run.returncode:
            raise RuntimeError(f"the loading process failed: {run.stderr.strip().splitlines()[-1:]}")
        rss = json.loads(run.stdout.strip().splitlines()[-1])
        largest = max(sizes)
        report.say(f"loading: {layers} layers, {len(sizes)} shards, {sum(sizes) / 1e9:.1f} GB (largest "
                   f"{largest / 1e9:.2f} GB), written in {written:.0f} s; loaded in {rss['seconds']:.0f} s with peak "
                   f"RSS growth {rss['peak'] / 1e9:.2f} GB = {rss['peak'] / largest:.2f}x the largest shard "
                   "(bound 1.5x)",
                   shards=sizes, peak_rss_growth=rss["peak"], ratio=rss["peak"] / largest,
                   load_seconds=rss["seconds"])  # fmt: skip
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    run_parts(__doc__.split("\n\n")[0], {"linears": linears, "loading": loading}, "bench_fp8")
