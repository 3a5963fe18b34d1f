"""Command line: `hsmc generate --config X [--prompt P | --prompts-file F] [key=value ...]`."""

from __future__ import annotations

import argparse
import dataclasses
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
    if args.stream:
        results = _print_stream(decoder, prompts, args.json)
    else:
        with tqdm(total=len(prompts), desc="prompts", unit="prompt", disable=len(prompts) < 2, file=sys.stderr) as bar:
            results = decoder.generate(prompts, on_finish=lambda _: bar.update())
    if args.json:
        if not args.stream:
            for i, result in enumerate(results):
                print(json.dumps({"index": i, "prompt": prompts[i], **dataclasses.asdict(result)}))
        return
    if not args.stream:
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


def _print_stream(decoder, prompts: list[str], as_json: bool) -> list:
    """Print each prompt's text as it settles, prompt after prompt (text of a later prompt that settles early
    waits for its turn); with `as_json` every increment as it comes, one JSON line each, the result on the last."""
    results, waiting, shown = {}, [""] * len(prompts), 0
    start = time.perf_counter()
    if not as_json:
        print(f"### {prompts[0]}", flush=True)
    for increment in decoder.stream(prompts):
        i = increment.index
        if increment.result is not None:
            results[i] = increment.result
        if as_json:
            result = dataclasses.asdict(increment.result) if increment.result else None
            print(json.dumps({"index": i, "text": increment.text, "token_ids": increment.token_ids, "result": result}))
            continue
        waiting[i] += increment.text
        while shown < len(prompts):
            print(waiting[shown], end="", flush=True)
            waiting[shown] = ""
            if shown not in results:
                break
            shown += 1
            print("\n" + (f"\n### {prompts[shown]}" if shown < len(prompts) else ""), flush=True)
    levels = decoder.level_stats(time.perf_counter() - start)
    for result in results.values():
        result.stats["levels"] = levels
    return [results[i] for i in range(len(prompts))]


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="hsmc", description="Hierarchical speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    gen.add_argument("--config", required=True, help="YAML config (e.g. configs/demo.yaml)")
    source = gen.add_mutually_exclusive_group()
    source.add_argument("--prompt", help="one prompt")
    source.add_argument("--prompts-file", help="a text file (one prompt per line) or .jsonl with a 'prompt' field")
    gen.add_argument(
        "--stream", action="store_true", help="print text as it settles (smc: the prefix all particles share)"
    )
    gen.add_argument(
        "--json", action="store_true", help="print one JSON object per prompt (with --stream: per increment)"
    )
    gen.add_argument("overrides", nargs="*", help="config overrides, e.g. generation.max_new_tokens=64")
    train = sub.add_parser("train-eagle", help="train an EAGLE3 head for a verifier (resumes from checkpoints)")
    train.add_argument(
        "--config", required=True, help="YAML with the TrainEagleConfig keys (configs/train_eagle_demo.yaml)"
    )
    train.add_argument("overrides", nargs="*", help="config overrides, e.g. steps=500")
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
    args = parser.parse_args(argv)
    try:
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
