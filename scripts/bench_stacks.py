"""Tokens/s and per-level statistics of several stacks on the demo prompt set, same machine, same run.

    python scripts/bench_stacks.py [--max-new-tokens 64] [--draft-layers 24]

Stacks (SmolLM2-135M-Instruct, T = 0.7, the demo's prompts): the target alone; draft-model SD
(layer-truncated draft, lossless rejection); SMC-SD (draft proposes, smc reweights N=4, K=4);
the demo config; and with --head, an EAGLE3 head under rejection, with and without an smc level
on top, and under rejection with `num_draft_tokens: auto` (the cost model picks γ, or none, from the forward times it
measures at start). The target-alone row is the baseline of the ratio column.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch

from hsmc.config import load_config
from hsmc.decoder import HierarchicalDecoder

M = "smollm2-135m-instruct"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--draft-layers", type=int, default=24)
    parser.add_argument("--head", help="an EAGLE3 head for SmolLM2: adds the eagle3 two- and three-level stacks")
    args = parser.parse_args()
    demo = load_config("configs/demo.yaml")
    draft = {"model": M, "num_layers": args.draft_layers, "temperature": 0.7}
    target = {"model": M, "temperature": 0.7}
    stacks = {
        "target alone": [target],
        "draft -> rejection": [draft, {**target, "kind": "rejection", "num_draft_tokens": 4}],
        "draft -> smc (N=4, K=4)": [draft, {**target, "kind": "smc", "particles": 4, "block_size": 4}],
        "demo config": [{k: v for k, v in vars(lc).items() if v is not None} for lc in demo.levels],
    }
    if args.head:
        eagle = {"kind": "eagle3", "model": args.head, "temperature": 0.7}
        rejection = {**target, "kind": "rejection", "num_draft_tokens": 4}
        stacks["eagle3 -> rejection"] = [eagle, rejection]
        stacks["eagle3 -> rejection, gamma auto"] = [eagle, {**rejection, "num_draft_tokens": "auto"}]
        stacks["eagle3 -> rejection -> smc a=2"] = [
            eagle,
            rejection,
            {**target, "kind": "smc", "alpha": 2.0, "particles": 4, "block_size": 4},
        ]
    print(f"device: CPU ({platform.machine()}, {torch.get_num_threads()} threads); {len(demo.prompts)} demo prompts,")
    print(f"max_new_tokens={args.max_new_tokens}, draft = first {args.draft_layers} of 30 layers, seed 0")
    print(f"{'stack':<36} {'tok/s':>6} {'ratio':>6}  level stats")
    baseline = None
    for name, levels in stacks.items():
        decoder = HierarchicalDecoder.from_config(
            {"levels": levels, "engine": {"kv_capacity_tokens": 4096, "max_batch_rows": 16}}
        )
        decoder.generate(demo.prompts[:1], max_new_tokens=4)  # warm-up
        start = time.perf_counter()
        results = decoder.generate(demo.prompts, max_new_tokens=args.max_new_tokens)
        rate = sum(len(r.token_ids) for r in results) / (time.perf_counter() - start)
        baseline = baseline or rate
        stats = "; ".join(
            ", ".join(f"{k} {v:.2f}" for k, v in lv.items() if k not in ("model", "kind", "share_of_time"))
            for lv in results[0].stats["levels"]
            if lv["kind"] in ("rejection", "smc")
        )
        print(f"{name:<36} {rate:>6.1f} {rate / baseline:>5.2f}x  {stats}")


if __name__ == "__main__":
    main()
