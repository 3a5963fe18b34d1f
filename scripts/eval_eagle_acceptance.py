"""Mean accepted length of [eagle3 head, rejection verifier] on held-out GSM8K test questions.

    python scripts/eval_eagle_acceptance.py --head runs/eagle3-smollm2/head [--questions 50]

Compares the trained head with an untrained one (same shapes and vocabulary mapping, random
weights), greedy (T = 0, so both outputs equal the verifier's own greedy decode), 64 new tokens,
and reports tokens/s of the verifier alone in the same run.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from hsmc.decoder import HierarchicalDecoder
from hsmc.eagle.checkpoint import load_eagle3_head, save_eagle3_head
from hsmc.training.trainer import init_head

GSM8K_TEST = Path(__file__).resolve().parents[1] / "evals" / "data" / "gsm8k_test.jsonl"


def run(levels: list[dict], questions: list[str], new_tokens: int) -> tuple[float, float | None]:
    decoder = HierarchicalDecoder.from_config(
        {"levels": levels, "engine": {"kv_capacity_tokens": 16384, "max_batch_rows": 25}}
    )
    start = time.perf_counter()
    results = decoder.generate(questions, max_new_tokens=new_tokens)
    rate = sum(len(r.token_ids) for r in results) / (time.perf_counter() - start)
    stats = results[0].stats["levels"][-1]
    return rate, stats.get("mean_accepted_length")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--head", required=True)
    parser.add_argument("--verifier", default="smollm2-135m-instruct")
    parser.add_argument("--questions", type=int, default=50)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--gamma", type=int, default=4)
    args = parser.parse_args()
    questions = [json.loads(line)["question"] for line in GSM8K_TEST.read_text().splitlines()[: args.questions]]
    trained, config = load_eagle3_head(args.head)
    untrained_dir = Path(tempfile.mkdtemp()) / "untrained"
    save_eagle3_head(init_head(config, trained.d2t, trained.t2d, torch.device("cpu"), seed=1), config, untrained_dir)
    verifier = {"kind": "rejection", "model": args.verifier, "num_draft_tokens": args.gamma}
    print(
        f"device: CPU ({platform.machine()}, {torch.get_num_threads()} threads); {args.questions} GSM8K test "
        f"questions, greedy, {args.new_tokens} new tokens, gamma={args.gamma}"
    )
    print(f"{'stack':<34} {'tok/s':>6} {'mean accepted length':>21}")
    base, _ = run([{"model": args.verifier}], questions, args.new_tokens)
    print(f"{'verifier alone':<34} {base:>6.1f} {'':>21}")
    for name, head in (("untrained head -> rejection", untrained_dir), ("trained head -> rejection", args.head)):
        rate, accepted = run([{"kind": "eagle3", "model": str(head)}, verifier], questions, args.new_tokens)
        print(f"{name:<34} {rate:>6.1f} {accepted:>21.2f}")


if __name__ == "__main__":
    main()
