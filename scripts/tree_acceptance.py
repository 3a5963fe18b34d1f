"""Accepted length per verify of a chain and of draft trees (target_only, draft_aware, traversal) at one budget.

    python scripts/tree_acceptance.py [--questions 50] [--budgets 8 16 32] [--temperatures 0 1]

[eagle3 head, rejection SmolLM2] on the first GSM8K test questions (the shipped head and the offline SmolLM2 of
configs/demo.yaml): each row verifies `budget` drafts per round — a chain of γ = budget, or a tree of that budget
(depth and top-k from SHAPES). draft_aware and traversal draw their children from the head's law, so their head
needs T > 0 (1 at T = 0, where a greedy verifier makes them draft the top-k as target_only does). Prints one row
per (T, budget, drafting): mean accepted length per verify (tokens emitted per round) and tokens/s on this machine.
Any head temperature keeps draft_aware exact (children are drawn from the law they are verified against):
--draft-aware-temperature tries a sharper one. --self-draft-layers N drafts with a `model` level instead: the
verifier's first N layers (its own KV, a full language model's law at every depth of the tree).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from hsmc.decoder import HierarchicalDecoder
from hsmc.speculative.tree_verify import DRAWN_RULES

ROOT = Path(__file__).resolve().parents[1]
GSM8K_TEST = ROOT / "evals" / "data" / "gsm8k_test.jsonl"
HEAD = ROOT / "assets" / "eagle3-smollm2-135m-instruct"
# budget -> (depth, topk): the best draft_aware shape of a 12-question sweep at T = 1 with the shipped head
# (docs/measurements/2026-11-28-cpu-tree-shape-sweep.txt); at 32, 6 x 6 over that sweep's 12 x 3: on 50 questions it
# accepted more with both shipped heads, at T = 1 and at T = 0 (2026-11-29-cpu-tree-acceptance-t1-full-head.txt)
SHAPES = {8: (5, 3), 16: (8, 3), 32: (6, 6)}


def drafting(
    kind: str, budget: int, temperature: float, aware_t: float | None, shapes: dict[int, tuple[int, int]]
) -> tuple[float, dict]:
    """(head temperature, rejection level keys) of one way to draft `budget` tokens per verify; `aware_t`: the
    head's temperature for draft_aware (default: the verifier's, 1 at T = 0); `shapes`: budget -> (depth, topk)."""
    if kind == "chain":
        return temperature, {"num_draft_tokens": budget}
    depth, topk = shapes[budget]
    head_t = temperature
    if kind in DRAWN_RULES:
        head_t = aware_t if aware_t is not None else (temperature or 1.0)
    return head_t, {"tree": {"depth": depth, "topk": topk, "budget": budget}, "tree_rule": kind}


def run(args: argparse.Namespace, kind: str, budget: int, temperature: float, questions: list[str]):
    shapes = {b: tuple(args.tree_shape) for b in SHAPES} if args.tree_shape else SHAPES
    head_t, rejection = drafting(kind, budget, temperature, args.draft_aware_temperature, shapes)
    if args.self_draft_layers:  # a `model` drafter: the verifier's first layers, with its own KV and full law
        drafter = {"kind": "model", "model": args.verifier, "num_layers": args.self_draft_layers}
    else:
        drafter = {"kind": "eagle3", "model": args.head, "dtype": "bfloat16"}
    levels = [
        {**drafter, "temperature": head_t},
        {"kind": "rejection", "model": args.verifier, "temperature": temperature, **rejection},
    ]
    decoder = HierarchicalDecoder.from_config(
        {"levels": levels, "engine": {"kv_capacity_tokens": 16384, "max_batch_rows": len(questions)}}
    )
    start = time.perf_counter()
    results = decoder.generate(questions, max_new_tokens=args.new_tokens, seed=0)
    rate = sum(len(r.token_ids) for r in results) / (time.perf_counter() - start)
    return results[0].stats["levels"][-1]["mean_accepted_length"], rate


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--head", default=str(HEAD))
    parser.add_argument("--verifier", default="smollm2-135m-instruct")
    parser.add_argument("--self-draft-layers", type=int, help="draft with the verifier's first N layers, not --head")
    parser.add_argument("--questions", type=int, default=50)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--budgets", type=int, nargs="+", default=[8, 16, 32], choices=sorted(SHAPES))
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--kinds", nargs="+", default=["chain", "target_only", "draft_aware", "traversal"])
    parser.add_argument("--draft-aware-temperature", type=float, help="the head's temperature for draft_aware")
    parser.add_argument("--tree-shape", type=int, nargs=2, metavar=("DEPTH", "TOPK"), help="every budget's tree")
    args = parser.parse_args()
    lines = GSM8K_TEST.read_text().splitlines()[: args.questions]
    questions = [json.loads(line)["question"] for line in lines]
    print(
        f"device: CPU ({platform.machine()}, {torch.get_num_threads()} threads); {len(questions)} GSM8K test "
        f"questions, {args.new_tokens} new tokens; tree shapes (depth, topk) by budget: "
        f"{tuple(args.tree_shape) if args.tree_shape else SHAPES}"
    )
    print(f"{'T':>4} {'budget':>6} {'drafting':<12} {'accepted/verify':>15} {'tok/s':>6}")
    for temperature in args.temperatures:
        for budget in args.budgets:
            for kind in args.kinds:
                accepted, rate = run(args, kind, budget, temperature, questions)
                print(f"{temperature:>4.1f} {budget:>6} {kind:<12} {accepted:>15.2f} {rate:>6.1f}", flush=True)


if __name__ == "__main__":
    main()
