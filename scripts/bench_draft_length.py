"""`num_draft_tokens: auto` (and `tree: auto`) against the target alone and fixed γ, same run, batch 1 (issue 32:
auto must never be slower than the target alone by more than the noise, and on a GPU match the best fixed setting).

    python scripts/bench_draft_length.py [--questions 4] [--new-tokens 64] [--temperature 0 1] [--repeats 3]
        [--gammas 2 4 auto tree-auto 5x4x16] [--tree-rule target_only] [--device cuda|cpu]

`--gammas` takes fixed chains (γ), `auto`, `tree-auto` and fixed trees DEPTHxTOPKxBUDGET (verified by `--tree-rule`,
as are tree-auto's trees): the best fixed setting is the one auto must match.

Target: SmolLM2-135M-Instruct (fp32, or `--dtype bfloat16`). Drafters: its first 10 of 30 layers (a 1 : 3
self-draft) and the shipped EAGLE3 head. Each prompt is a chat-templated GSM8K question decoded alone; tok/s is the
median of `--repeats` passes over the questions after a warm-up pass (auto's start-up timing is not counted: it
happens in the constructor), the passes interleaved over the settings, each round starting one setting later, so
that a drift of the machine's speed shifts all alike.
Prints the device, the target-alone baseline, each setting's decode tok/s (the prefill's time subtracted) and
end-to-end tok/s (prefills included: a drafter's prefill is part of its cost), accepted length, mean γ, both
ratios to the baseline, the CUDA graphs captured during the timed passes (a capture inside them is timed as decode:
each arm of auto, or a length bucket first reached there, captures its own round graph at first use), and the
noise: the range of each pass's decode ratio to the target alone's pass of the same round (for the target alone, of
its passes against their median).

`--explain [γ ...]` prints instead where a round's time goes, rounds of each γ given (0 if none: auto's floor;
`auto`: auto left to choose, which leaves its drafters out once it never drafts) against the target's step: per
round, the wall time and the tokens it yields, on CUDA the time the GPU was busy (the union of the kernels' spans
under torch.profiler: below the wall time, the host keeps the GPU waiting), and the kernels (CUDA) or the aten ops
of the top's steps (CPU), their count and summed time, and those that differ most from the target alone's (by time
on CUDA, by count on the CPU, where an op's time is mostly the machine's noise).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from hsmc.config import TREE_RULES
from hsmc.decoder import HierarchicalDecoder
from hsmc.levels.tree import TreeShape
from hsmc.models.demo import demo_model_folder

ROOT = Path(__file__).resolve().parents[1]
GSM8K = ROOT / "evals" / "data" / "gsm8k_test.jsonl"
HEAD = ROOT / "assets" / "eagle3-smollm2-135m-instruct"


def _gamma(text: str) -> int | str:
    return text if text == "auto" or text.startswith("tree") else int(text)


def _setting(text: str) -> int | str | TreeShape:
    """A `--gammas` entry: γ, auto, tree-auto, or a fixed tree DEPTHxTOPKxBUDGET."""
    if text in ("auto", "tree-auto"):
        return text
    if "x" in text:
        return TreeShape(*(int(part) for part in text.split("x")))
    return int(text)


def _label(gamma: int | str | TreeShape) -> str:
    return f"{gamma.depth}x{gamma.topk}x{gamma.budget}" if isinstance(gamma, TreeShape) else str(gamma)


def _levels(drafter: str | None, gamma: int | str | TreeShape, temperature: float, dtype: str, rule: str) -> list[dict]:
    target = {"model": str(demo_model_folder("smollm2-135m-instruct")), "dtype": dtype, "temperature": temperature}
    if drafter is None:
        return [{"kind": "model", **target}]
    below = {"kind": "eagle3", "model": str(HEAD), "dtype": "bfloat16", "temperature": temperature}
    if drafter == "self-draft":
        below = {"kind": "model", **target, "num_layers": 10}
    top = {"kind": "rejection", **target, "num_draft_tokens": gamma}
    if gamma == "tree-auto":  # chains and trees
        top.update(num_draft_tokens="auto", tree="auto", tree_rule=rule)
    elif isinstance(gamma, TreeShape):
        top.update(num_draft_tokens=gamma.depth, tree=dataclasses.asdict(gamma), tree_rule=rule)
    return [below, top]


def _pass(decoder: HierarchicalDecoder, questions: list[str], new_tokens: int) -> tuple[float, float, list[dict]]:
    """Seconds of decoding each question alone (prefills included), of its decode alone (its one-token run, the
    prefill's, subtracted), and the top level's stats."""
    whole, decode, stats = 0.0, 0.0, []
    for i, q in enumerate(questions):
        spans = []
        for n in (1, new_tokens):
            began = time.perf_counter()
            (result,) = decoder.generate([q], max_new_tokens=n, ignore_eos=True, seed=i)
            spans.append(time.perf_counter() - began)
        whole, decode = whole + spans[1], decode + spans[1] - spans[0]
        stats.append(result.stats["levels"][-1])
    return whole, decode, stats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--gammas", nargs="+", type=_setting, default=[2, 4, "auto"], help="fixed γs, auto, tree-auto, trees DxKxB"
    )
    parser.add_argument("--tree-rule", default="target_only", choices=TREE_RULES, help="the trees' verification rule")
    parser.add_argument("--drafters", nargs="+", default=["self-draft", "eagle3"], choices=["self-draft", "eagle3"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="the target's and self-draft's"
    )
    parser.add_argument(
        "--warmup", action="store_true", help="engine.warmup: capture every shape's graph before the first pass"
    )
    parser.add_argument(
        "--explain", nargs="*", type=_gamma, help="where a round of each γ (auto; treeI: tree I of tree: auto) goes"
    )
    args = parser.parse_args()
    questions = [json.loads(line)["question"] for line in GSM8K.read_text().splitlines()[: args.questions]]
    if args.device == "cuda":
        device = f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA graphs"
    else:
        cpu = platform.processor() or platform.machine()
        device = f"CPU {cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}"
    if args.explain is not None:
        return _explain(args, questions[0], device, args.explain or [0])
    warmed = ", engine.warmup" if args.warmup else ""
    print(f"device: {device}; SmolLM2-135M-Instruct {args.dtype}, batch 1, {len(questions)} GSM8K questions x "
          f"{args.new_tokens} new tokens, median of {args.repeats} passes{warmed}")  # fmt: skip
    print(f"{'T':>4} {'drafter':>10} {'γ':>9} {'decode tok/s':>12} {'x target':>8} {'e2e tok/s':>9} {'x target':>8} "
          f"{'accepted':>8} {'mean γ':>6} {'captured':>8}  pass by pass (decode)")  # fmt: skip
    settings = [(None, 0)] + [(d, g) for d in args.drafters for g in args.gammas]
    for temperature in args.temperature:
        decoders = {}
        for drafter, gamma in settings:
            decoders[drafter, gamma] = HierarchicalDecoder.from_config(
                {
                    "levels": _levels(drafter, gamma, temperature, args.dtype, args.tree_rule),
                    "engine": {"max_batch_rows": 1, "device": args.device, "warmup": args.warmup},
                }
            )
            _pass(decoders[drafter, gamma], questions, args.new_tokens)  # warm-up
        # passes interleaved over the settings, each round starting one setting later: a drift of the machine's
        # speed shifts every setting alike, and none always runs first (on an H200 the target alone, then always
        # first, ran 2 of its 3 passes ~20 % slower than the third, cause unknown:
        # docs/measurements/2026-11-30-h200-tree-auto-against-fixed-trees.txt)
        runs: dict[tuple, list] = {setting: [] for setting in settings}
        warm = {setting: decoder.stack.scope.graphs_captured() for setting, decoder in decoders.items()}
        for round_ in range(args.repeats):
            for setting in settings[round_ % len(settings) :] + settings[: round_ % len(settings)]:
                runs[setting].append(_pass(decoders[setting], questions, args.new_tokens))
        base = base_whole = None
        base_passes = [r[1] for r in runs[None, 0]]
        for (drafter, gamma), decoder in decoders.items():
            passes = runs[drafter, gamma]
            # the noise: each pass against the target alone's pass of the same round (for the target alone itself,
            # against its median)
            if drafter is None:
                paired = [statistics.median(base_passes) / b for b in base_passes]
            else:
                paired = [b / r[1] for b, r in zip(base_passes, passes)]
            tok_s = len(questions) * (args.new_tokens - 1) / statistics.median(r[1] for r in passes)
            whole = len(questions) * args.new_tokens / statistics.median(r[0] for r in passes)
            base, base_whole = base or tok_s, base_whole or whole
            stats = [s for r in passes for s in r[2]]
            accepted = statistics.mean(s.get("mean_accepted_length", 1.0) for s in stats)
            fixed = gamma.depth if isinstance(gamma, TreeShape) else gamma or 0
            mean_gamma = statistics.mean(s.get("mean_draft_tokens", fixed) for s in stats)
            label = "-" if drafter is None else _label(gamma)
            captured = decoder.stack.scope.graphs_captured() - warm[drafter, gamma]
            print(f"{temperature:>4g} {drafter or 'none':>10} {label:>9} {tok_s:12.1f} {tok_s / base:7.2f}x "
                  f"{whole:9.1f} {whole / base_whole:7.2f}x {accepted:8.2f} {mean_gamma:6.2f} {captured:8d}  "
                  f"{min(paired):.2f}-{max(paired):.2f}x", flush=True)  # fmt: skip
            if drafter is not None and gamma in ("auto", "tree-auto"):
                choice = decoder.stack.top.draft_length
                for rows, times in choice.round_ms.items():
                    every = choice.probe_every(rows)
                    probes = "never" if every is None else f"every {every} rounds"
                    print(f"     {gamma}'s round times at start, {rows} row(s) (ms, γ = 0..{choice.most}, then trees): "
                          + " ".join(f"{t:.2f}" for t in times)
                          + f"; the drafters' catch-up {choice.catch_up(rows):.2f} ms a round; a probe {probes}",
                          flush=True)  # fmt: skip
                print(f"     {gamma}'s estimate of a draft's acceptance after the passes: α = {choice.rate:.2f}")
            decoder.close()


def _explain(args: argparse.Namespace, question: str, device: str, gammas: list[int | str]) -> None:
    cuda = args.device == "cuda"
    n = args.new_tokens
    counted = "kernels of the graphed decoder under torch.profiler" if cuda else "aten ops of the top's steps"
    print(
        f"device: {device}; SmolLM2-135M-Instruct {args.dtype}, batch 1, the first GSM8K question, per round of a "
        f"decode of {n} new tokens less one of 1; auto's γ forced but for `auto`; {counted}"
        + ("; busy: the union of the kernels' spans" * cuda)
    )
    for temperature in args.temperature:
        ops = {}
        for drafter, gamma in [(None, 0), *((d, g) for d in args.drafters for g in gammas)]:
            decoder = _forced(drafter, gamma, temperature, args, question)
            ops[drafter, gamma], busy, tokens = _per_round_ops(decoder, question, n, cuda)
            wall = statistics.median(_pass(decoder, [question], n)[1] for _ in range(args.repeats)) / (n - 1) * 1e3
            label = "none" if drafter is None else f"{drafter} γ={gamma}"
            if gamma == "auto":
                label = f"{drafter} {'auto, idle' if decoder.stack.top.draft_length.idle else 'auto'}"
            decoder.close()
            count, ms = sum(c for c, _ in ops[drafter, gamma].values()), sum(t for _, t in ops[drafter, gamma].values())
            print(
                f"T={temperature:g} {label:>21}: wall {wall * tokens:.3f} ms/round ({tokens:.2f} tokens)"
                + (f", GPU busy {busy:.3f}" if cuda else "")
                + f"; {count:.0f} {'kernels' if cuda else 'ops'}/round summing {ms:.3f} ms",
                flush=True,
            )
            if drafter is not None:
                mine, target = ops[drafter, gamma], ops[None, 0]
                names = set(mine) | set(target)
                diff = {k: _per_round(mine.get(k, (0, 0.0)), target.get(k, (0, 0.0)), 1) for k in names}
                for name, (c, t) in sorted(diff.items(), key=lambda kv: -abs(kv[1][1 if cuda else 0]))[:12]:
                    print(f"      {name[:72]:72} {c:+7.1f}/round {t * 1e3:+8.1f} us/round")


def _forced(
    drafter: str | None, gamma: int | str, temperature: float, args: argparse.Namespace, question: str
) -> HierarchicalDecoder:
    """The target alone, or a drafter's auto taking γ every round (left to choose if γ is `auto`; `treeI`: the I-th
    tree of `tree: auto`, counted from 1); warmed up."""
    tree = isinstance(gamma, str) and gamma.startswith("tree")
    gamma_of_levels = ("tree-auto" if tree else "auto") if drafter is not None else 0
    levels = _levels(drafter, gamma_of_levels, temperature, args.dtype, args.tree_rule)
    decoder = HierarchicalDecoder.from_config(
        {"levels": levels, "engine": {"max_batch_rows": 1, "device": args.device}}
    )
    if drafter is not None and gamma != "auto":
        choice = decoder.stack.top.draft_length
        choice.forced = choice.most + int(gamma[4:]) if tree else gamma  # treeI: the I-th of AUTO_TREES
    _pass(decoder, [question], args.new_tokens)
    return decoder


def _per_round_ops(
    decoder: HierarchicalDecoder, question: str, n: int, cuda: bool
) -> tuple[dict[str, tuple[float, float]], float, float]:
    """Kernel (CUDA) or op (CPU) name -> (count, ms) per round, the GPU's busy ms per round (CUDA), and the tokens a
    round yields: a profiled decode of n tokens less one of 1."""
    top = decoder.stack.top
    step = top.step
    rounds = [0]

    def counting(rows: torch.Tensor):  # noqa: ANN202
        rounds[0] += 1
        return step(rows)

    top.step = counting
    try:
        runs = []
        for tokens in (1, n):
            before = rounds[0]
            ops, busy = _kernels(decoder, question, tokens) if cuda else (_ops(decoder, question, tokens), 0.0)
            runs.append((ops, busy, rounds[0] - before))
    finally:
        del top.step
    (short, short_busy, short_rounds), (long, long_busy, long_rounds) = runs
    count = max(long_rounds - short_rounds, 1)
    per_round = {k: _per_round(long[k], short.get(k, (0, 0.0)), count) for k in long}
    return per_round, (long_busy - short_busy) / count, (n - 1) / count


def _kernels(decoder: HierarchicalDecoder, question: str, tokens: int) -> tuple[dict[str, tuple[int, float]], float]:
    """The CUDA kernels of one decode under torch.profiler (it sees the request loop's thread and the kernels of
    replayed graphs; under programmatic dependent launch a kernel's time includes its wait on the one before), and
    the ms the GPU was busy: the union of their spans."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        decoder.generate([question], max_new_tokens=tokens, ignore_eos=True, seed=0)
    rows = [(e.key, e.count, e.self_device_time_total) for e in prof.key_averages()]
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type.name == "CUDA")
    busy, end = 0.0, float("-inf")
    for start, stop in spans:
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return {name: (count, us / 1e3) for name, count, us in rows if us > 0}, busy / 1e3


def _ops(decoder: HierarchicalDecoder, question: str, tokens: int) -> dict[str, tuple[int, float]]:
    """aten ops of the top's steps in one decode, and their time: a dispatch mode on the request loop's thread
    (where the profiler does not look)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: dict[str, tuple[int, float]] = {}

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            began = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            count, ms = seen.get(str(func), (0, 0.0))
            seen[str(func)] = (count + 1, ms + (time.perf_counter() - began) * 1e3)
            return out

    top = decoder.stack.top
    wrapped, step = "step" in vars(top), top.step

    def counted(rows: torch.Tensor):  # noqa: ANN202
        with Count():
            return step(rows)

    top.step = counted
    try:
        decoder.generate([question], max_new_tokens=tokens, ignore_eos=True, seed=0)
    finally:
        if wrapped:
            top.step = step
        else:
            del top.step
    return seen


def _per_round(long: tuple[int, float], short: tuple[int, float], rounds: int) -> tuple[float, float]:
    """(count, ms) per round of the difference of two runs."""
    return (long[0] - short[0]) / rounds, (long[1] - short[1]) / rounds


if __name__ == "__main__":
    main()
