"""Speculative decoding with several prompts decoded together, on the CPU with the real SmolLM2 weights.

    python scripts/bench_speculative_batching.py [--prompts 6] [--new-tokens 64] [--draft-layers 8]

A rejection top runs one draft/verify cycle for every row per step, so B prompts cost as many verifier
forwards as the slowest row needs cycles (rows accept different numbers of drafts: ragged), not the sum
over rows. Whether a stack beats the target alone then follows from two measured numbers: the mean
accepted length a (tokens per cycle) and the cost c of one draft step relative to one target step; a
cycle costs about gamma*c + v target steps (v: the verify forward of gamma+1 tokens per row, relative
to a one-token step), so the speedup is about a / (gamma*c + v). The table reports the measured speed
next to that prediction. Greedy throughout: every stack's output equals the target's token for token
(checked here).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from hsmc.decoder import HierarchicalDecoder
from hsmc.models.demo import demo_model_folder

ROOT = Path(__file__).resolve().parents[1]
GSM8K = ROOT / "evals" / "data" / "gsm8k_test.jsonl"
HEAD = ROOT / "assets" / "eagle3-smollm2-135m-instruct"


def timed_generate(decoder: HierarchicalDecoder, prompts: list[str], new_tokens: int) -> tuple[float, list]:
    start = time.perf_counter()
    results = decoder.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True)
    return time.perf_counter() - start, results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--draft-layers", type=int, default=8)
    parser.add_argument("--gamma", type=int, default=4)
    args = parser.parse_args()
    model = str(demo_model_folder("smollm2-135m-instruct"))
    prompts = [json.loads(line)["question"] for line in GSM8K.read_text().splitlines()[: args.prompts]]
    engine = {"kv_capacity_tokens": 8192, "max_batch_rows": 16}
    target = {"model": model}
    verify = {"kind": "rejection", "model": model, "num_draft_tokens": args.gamma}
    stacks = {
        "target alone": [target],
        f"first {args.draft_layers} layers -> rejection": [{"model": model, "num_layers": args.draft_layers}, verify],
        "eagle3 head -> rejection": [{"kind": "eagle3", "model": str(HEAD), "dtype": "float32"}, verify],
    }
    print(f"device: CPU ({platform.machine()}, {torch.get_num_threads()} threads); SmolLM2-135M-Instruct fp32, greedy;")
    print(f"{args.prompts} GSM8K questions decoded together, {args.new_tokens} new tokens each, gamma={args.gamma}")
    print(f"{'stack':<32}{'tok/s':>7}{'ratio':>7}{'accepted':>9}{'c':>6}{'v':>6}{'predicted':>10}"
          f"{'verify fwd':>11}{'sum of rows':>12}")  # fmt: skip
    baseline_rate = reference = None
    for name, levels in stacks.items():
        decoder = HierarchicalDecoder.from_config({"levels": levels, "engine": engine})
        decoder.generate(prompts[:1], max_new_tokens=4)  # warm-up
        top = decoder.stack.top
        runner = top.state.runner
        calls = {"n": 0}
        forward = runner.forward

        def counted(*a, _forward=forward, **k):
            calls["n"] += 1
            return _forward(*a, **k)

        runner.forward = counted
        seconds, results = timed_generate(decoder, prompts, args.new_tokens)
        batched_forwards = calls["n"]
        rate = args.prompts * args.new_tokens / seconds
        tokens = [r.token_ids for r in results]
        if reference is None:
            baseline_rate, reference, step_seconds = rate, tokens, seconds / args.new_tokens
            print(f"{name:<32}{rate:>7.1f}{1:>6.2f}x")
            continue
        assert tokens == reference, f"{name}: greedy output differs from the target's"
        per_row = 0
        for p in prompts:  # verifier forwards each row needs on its own
            calls["n"] = 0
            decoder.generate([p], max_new_tokens=args.new_tokens, ignore_eos=True)
            per_row += calls["n"]
        levels_stats = results[0].stats["levels"]
        accepted = levels_stats[-1]["mean_accepted_length"]
        cycles = batched_forwards - 1
        draft_step = levels_stats[0]["share_of_time"] * seconds / (cycles * args.gamma)
        verify_step = levels_stats[-1]["share_of_time"] * seconds / cycles
        c, v = draft_step / step_seconds, verify_step / step_seconds
        predicted = accepted / (args.gamma * c + v)
        print(f"{name:<32}{rate:>7.1f}{rate / baseline_rate:>6.2f}x{accepted:>9.2f}{c:>6.2f}{v:>6.2f}"
              f"{predicted:>9.2f}x{batched_forwards:>11}{per_row:>12}")  # fmt: skip
    print("c: a draft step / a target step; v: a verify forward / a target step (both measured in this run);")
    print(
        "verify fwd: verifier forwards for all prompts together (prefill included); sum of rows: one prompt at a time"
    )


if __name__ == "__main__":
    main()
