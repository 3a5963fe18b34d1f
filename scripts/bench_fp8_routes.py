"""Batched FP8 SMC-SD at the compute bound (issue 30 item 6): the FP8 8B -> FP8 32B stack (N = 8, K = 8, FP8
activations) at 1 and 16 requests, in one run with the FP8-activation GEMMs on cuBLASLt's block-scaled GEMM alone
(from 2 rows on) and on the routes this GPU's tuning file picks (the Triton GEMM below its block-scaled rows,
flashinfer's GEMM where it measured faster, if installed), each against its weight-read bound; `--triton` adds
Triton's w8a8 kernel at every row count (the route before cuBLASLt's). `--prompt-tokens 2048` with `--row-by-row`
adds the tuned routes with the particles' attention read row by row (`paged_attention.shares_prefix` never taken),
the baseline of reading each request's shared prompt once.

    python scripts/bench_fp8_routes.py [--batch 1,16] [--prompt-tokens 128] [--new-tokens 128] [--triton]
        [--row-by-row] [--out DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hsmc.bench import run_bench, to_json  # noqa: E402
from hsmc.config import load_config  # noqa: E402
from hsmc.ops import paged_attention  # noqa: E402
from hsmc.ops.linear_router import router_for  # noqa: E402

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "bench" / "smc_8b_32b.yaml"
OVERRIDES = ["levels.0.dtype=fp8", "levels.1.dtype=fp8", "engine.fp8_activations=true", "engine.max_batch_rows=128"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", default="1,16")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--row-by-row", action="store_true", help="also run attention without the shared-prefix pass")
    parser.add_argument("--triton", action="store_true", help="also run the FP8-activation GEMMs on Triton's kernel")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    router = router_for(torch.device("cuda"))
    tuned = router.tuning
    on_flashinfer = len(tuned.fp8_flashinfer.gemms) if tuned.fp8_flashinfer else 0
    print(f"tuning: {tuned.source}; FP8 block-scaled: {tuned.fp8_block_scaled}; on flashinfer: {on_flashinfer}")
    shared_runs = paged_attention.MIN_SHARED_RUNS
    scaled = tuned.fp8_block_scaled
    from_two_rows = dataclasses.replace(scaled, min_rows=2) if scaled is not None else None
    variants = [
        ("cuBLASLt", dataclasses.replace(tuned, fp8_block_scaled=from_two_rows, fp8_flashinfer=None), shared_runs),
        ("tuned", tuned, shared_runs),
    ]
    if args.triton:
        triton_only = dataclasses.replace(tuned, fp8_block_scaled=None, fp8_flashinfer=None)
        variants.insert(0, ("triton w8a8", triton_only, shared_runs))
    if args.row_by_row:
        variants.append(("tuned, attention row by row", tuned, sys.maxsize))
    out = {}
    for label, tuning, runs in variants:
        router.tuning = tuning
        router._routes.clear()
        paged_attention.MIN_SHARED_RUNS = runs
        config = load_config(CONFIG, OVERRIDES)
        batches = [int(b) for b in args.batch.split(",")]
        rows, table = run_bench(
            [], config, batches, args.prompt_tokens, args.new_tokens, "bfloat16", False, {}, name=label
        )
        kernels = sorted({f"{route.kernel.value} x{rows}" for (rows, *_), route in router._routes.items() if rows > 16})
        print(f"== FP8-activation GEMMs: {label}\n{table}\nroutes above 16 rows: {', '.join(kernels)}", flush=True)
        out[label] = json.loads(to_json(rows))
        gc.collect()
        torch.cuda.empty_cache()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_fp8_routes.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
