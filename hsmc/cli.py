"""Command line: `hsmc generate --config X [--prompt P | --prompts-file F] [key=value ...]`, `hsmc train-eagle`,
`hsmc eval gsm8k|humaneval`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tqdm import tqdm

from hsmc.errors import HsmcError


def _read_prompts(args: argparse.Namespace, default: list[str]) -> list[str]:
    if args.prompt is not None:
        return [args.prompt]
    if args.prompts_file is not None:
        path = Path(args.prompts_file)
        if not path.is_file():
            raise HsmcError(f"--prompts-file: no such file {path}")
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        if path.suffix == ".jsonl":
            return [json.loads(line)["prompt"] for line in lines]
        return lines
    if not default:
        raise HsmcError("no prompts: pass --prompt, --prompts-file, or set `prompts` in the config")
    return default


def _generate(args: argparse.Namespace) -> None:
    from hsmc.decoder import HierarchicalDecoder

    load_start = time.perf_counter()
    decoder = HierarchicalDecoder.from_config(args.config, args.overrides)
    load_seconds = time.perf_counter() - load_start
    prompts = _read_prompts(args, decoder.config.prompts)
    with tqdm(total=len(prompts), desc="prompts", unit="prompt", disable=len(prompts) < 2, file=sys.stderr) as bar:
        results = decoder.generate(prompts, on_finish=lambda _: bar.update())
    for prompt, result in zip(prompts, results):
        print(f"### {prompt}\n{result.text}\n")
    total_tokens = sum(r.stats["new_tokens"] for r in results)
    seconds = max(r.stats["seconds"] for r in results)
    print(f"{'prompt':>6} {'new tokens':>10} {'finish':>7} {'seconds':>8} {'tok/s':>8}")
    for i, r in enumerate(results):
        s = r.stats
        print(f"{i:>6} {s['new_tokens']:>10} {r.finish_reason:>7} {s['seconds']:>8.2f} {s['tokens_per_s']:>8.1f}")
    print(f"{'total':>6} {total_tokens:>10} {'':>7} {seconds:>8.2f} {total_tokens / seconds:>8.1f}")
    print(
        f"\n{'level':<10} {'model':<28} {'time':>5}  stats"
        f"   (device {decoder.config.engine.device}, load {load_seconds:.1f}s)"
    )
    for level in results[0].stats["levels"]:
        extra = ", ".join(f"{k} {v:.2f}" for k, v in level.items() if k not in ("kind", "model", "share_of_time"))
        print(f"{level['kind']:<10} {level['model'][-28:]:<28} {level['share_of_time']:>5.0%}  {extra}")


def _bench(args: argparse.Namespace) -> None:
    import torch

    from hsmc.bench import run_bench, to_json
    from hsmc.config import load_config
    from hsmc.models.shapes import SHAPES

    if not torch.cuda.is_available():
        raise HsmcError("hsmc bench measures GPU decode speed and needs a CUDA device")
    shapes = [s for s in (args.shape or "").split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown or not (shapes or args.config):
        raise HsmcError(f"bench: pass --config or --shape with one of {', '.join(SHAPES)} (got {unknown or 'none'})")
    try:
        batches = [int(b) for b in args.batch.split(",")]
    except ValueError:
        raise HsmcError(f"bench: --batch takes comma-separated integers, got {args.batch!r}") from None
    config = load_config(args.config, args.overrides) if args.config else None
    engine = {
        "max_batch_rows": max(batches),
        "kv_capacity_tokens": max(batches) * (args.prompt_tokens + args.new_tokens + 64),
    }
    rows, table = run_bench(
        shapes, config, batches, args.prompt_tokens, args.new_tokens, args.dtype, not args.no_baseline, engine
    )
    print(to_json(rows) if args.json else table)
    if args.plot:
        from hsmc.bench import plot

        plot(rows, Path(args.plot))


def _add_bench_parser(sub: argparse._SubParsersAction) -> None:
    """`hsmc bench --shape S[,S] | --config X [--batch 1,4,16] ...` (see hsmc/bench.py)."""
    bench = sub.add_parser("bench", help="decode tok/s vs the bandwidth roofline and transformers (GPU)")
    bench.add_argument("--shape", help="comma-separated model shapes with random weights, e.g. qwen3-8b,qwen3-32b")
    bench.add_argument("--config", help="a config whose stack is measured as configured")
    bench.add_argument("--batch", default="1,4,16", help="comma-separated batch sizes (default 1,4,16)")
    bench.add_argument("--prompt-tokens", type=int, default=128)
    bench.add_argument("--new-tokens", type=int, default=256)
    bench.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    bench.add_argument("--no-baseline", action="store_true", help="skip transformers' eager generate")
    bench.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    bench.add_argument("--plot", help="write a tok/s-vs-batch chart (PNG) here")
    bench.add_argument("overrides", nargs="*", help="config overrides for --config")


def _add_eval_parser(sub: argparse._SubParsersAction) -> None:
    """`hsmc eval gsm8k|humaneval --config X [--config Y ...] [options] [key=value ...]` (see hsmc/evals/)."""
    tasks = sub.add_parser("eval", help="accuracy evals: GSM8K, HumanEval").add_subparsers(
        dest="task_name", required=True
    )
    for name, data in (
        ("gsm8k", "a jsonl with question/answer or a datasets id"),
        ("humaneval", "HumanEval.jsonl(.gz)"),
    ):
        task = tasks.add_parser(name, help=f"{name} accuracy of one or more configs, compared to the first")
        task.add_argument("--config", action="append", default=[], help="YAML config; repeat to compare stacks")
        task.add_argument("--limit", type=int, help="only the first N problems")
        task.add_argument("--data", help=f"{data} (default: the copy shipped in evals/data, else the hub)")
        task.add_argument("--task", help=f"task settings YAML (default evals/{name}.yaml)")
        task.add_argument("--out", help=f"folder for per-sample records and the summary (default runs/eval/{name})")
        task.add_argument("--json", action="store_true", help="print the summary as JSON")
        task.add_argument("--plot", action="store_true", help="draw accuracy vs tok/s (needs matplotlib)")
        if name == "humaneval":
            task.add_argument("--samples", action="append", help="score completions from a jsonl (task_id, completion)")
            task.add_argument("--workers", type=int, help="programs run in parallel (default: CPU count)")
            task.add_argument("--isolation", default="auto", choices=["auto", "namespaces", "landlock", "rlimits"])
        task.add_argument("overrides", nargs="*", help="config overrides (task.KEY=VALUE for task settings)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hsmc", description="Hierarchical speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("--config", required=True, help="YAML config (e.g. configs/demo.yaml)")
    source = gen.add_mutually_exclusive_group()
    source.add_argument("--prompt", help="one prompt")
    source.add_argument("--prompts-file", help="a text file (one prompt per line) or .jsonl with a 'prompt' field")
    gen.add_argument("overrides", nargs="*", help="config overrides, e.g. generation.max_new_tokens=64")
    train = sub.add_parser("train-eagle", help="train an EAGLE3 head for a verifier (resumes from checkpoints)")
    train.add_argument(
        "--config", required=True, help="YAML with the TrainEagleConfig keys (configs/train_eagle_demo.yaml)"
    )
    train.add_argument("overrides", nargs="*", help="config overrides, e.g. steps=500")
    _add_bench_parser(sub)
    _add_eval_parser(sub)
    args = parser.parse_args(argv)
    try:
        if args.command == "eval":
            from hsmc.evals.command import run_eval

            run_eval(args)
            return 0
        if args.command == "train-eagle":
            from hsmc.training.trainer import load_train_config, train_eagle

            train_eagle(load_train_config(args.config, args.overrides))
            return 0
        if args.command == "bench":
            _bench(args)
            return 0
        _generate(args)
    except (HsmcError, ValueError) as e:
        print(f"hsmc: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
