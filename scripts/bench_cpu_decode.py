"""Greedy decode throughput: hsmc's engine vs transformers' `generate`, same weights, same run.

    python scripts/bench_cpu_decode.py [--new-tokens 128] [--batch 1 4] [--repeats 3]

Both decode exactly `--new-tokens` tokens per prompt (EOS ignored) from chat-templated GSM8K
questions on SmolLM2-135M-Instruct (fp32). Prints a table with the device, the baseline, and
the ratio; the median of `--repeats` runs after one warm-up.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from hsmc.decoder import HierarchicalDecoder
from hsmc.models.demo import demo_model_folder
from hsmc.models.tokenizer import encode_prompt

GSM8K = Path(__file__).resolve().parents[1] / "evals" / "data" / "gsm8k_test.jsonl"


def _median_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    folder = demo_model_folder("smollm2-135m-instruct")
    decoder = HierarchicalDecoder.from_config(
        {"levels": [{"model": str(folder)}], "engine": {"max_batch_rows": max(args.batch), "kv_capacity_tokens": 4096}}
    )
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = decoder.tokenizer
    tok.padding_side = "left"
    questions = [json.loads(line)["question"] for line in GSM8K.read_text().splitlines()[: max(args.batch)]]
    n = args.new_tokens
    device = (
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    print(f"device: CPU ({device}); SmolLM2-135M-Instruct fp32, greedy, {n} new tokens per prompt")
    print(f"{'batch':>5} {'transformers tok/s':>19} {'hsmc tok/s':>11} {'ratio':>6}")
    for b in args.batch:
        prompts = questions[:b]
        ids = [encode_prompt(tok, q, chat_template=True) for q in prompts]
        texts = [tok.decode(i) for i in ids]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)

        def run_hf() -> None:
            with torch.no_grad():
                out = hf.generate(**enc, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            assert out.shape[1] == enc["input_ids"].shape[1] + n

        def run_hsmc() -> None:
            results = decoder.generate(ids, max_new_tokens=n, ignore_eos=True)
            assert all(len(r.token_ids) == n for r in results)

        t_hf = _median_seconds(run_hf, args.repeats)
        t_ours = _median_seconds(run_hsmc, args.repeats)
        print(f"{b:>5} {b * n / t_hf:>19.1f} {b * n / t_ours:>11.1f} {t_hf / t_ours:>5.2f}x")


if __name__ == "__main__":
    main()
