"""Command line: `hsmc generate`, `hsmc train-eagle`, `hsmc bench`, `hsmc eval`, `hsmc serve`, `hsmc tune-kernels`,
each registered by one `_add_*` function.

`key=value` config overrides may stand anywhere after the subcommand. A user error (an `HsmcError`)
is one line `hsmc: error: ...` and exit code 2; Ctrl-C is one line `hsmc: interrupted ...` and exit
code 130, after `generate` has printed the prompts that had finished. Anything else is a bug and
keeps its traceback. Heavy modules (torch, transformers) are imported only by the subcommand that
runs, so `hsmc --help` answers at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from hsmc import __version__
from hsmc.errors import HsmcError, PromptError


class _Parser(argparse.ArgumentParser):
    """argparse with hsmc's one-line error format."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"hsmc: error: {message} (see `{self.prog} --help`)\n")


def _add_generate(sub: Any) -> None:
    cmd = sub.add_parser("generate", help="generate text for one or more prompts")
    cmd.add_argument("--config", required=True, help="YAML config (e.g. configs/demo.yaml)")
    source = cmd.add_mutually_exclusive_group()
    source.add_argument("--prompt", help="one prompt")
    source.add_argument(
        "--prompts-file",
        help="a text file (one prompt per line) or .jsonl whose lines have a 'prompt' field (text or token ids)",
    )
    cmd.add_argument(
        "--stream", action="store_true", help="print text as it settles (smc: the prefix all particles share)"
    )
    cmd.add_argument(
        "--json", action="store_true", help="print one JSON object per prompt (with --stream: per increment)"
    )
    cmd.add_argument("overrides", nargs="*", help="config overrides, e.g. generation.max_new_tokens=64")
    cmd.set_defaults(run=_generate)


def _add_train_eagle(sub: Any) -> None:
    cmd = sub.add_parser("train-eagle", help="train an EAGLE3 head for a verifier (resumes from checkpoints)")
    cmd.add_argument("--config", required=True, help="YAML with the TrainEagleConfig keys (train_eagle_demo.yaml)")
    cmd.add_argument("overrides", nargs="*", help="config overrides, e.g. steps=500")
    cmd.set_defaults(run=_train_eagle)


def _add_bench(sub: Any) -> None:
    """`hsmc bench --shape S[,S] | --config X [--batch 1,4,16] ...` (see hsmc/bench.py)."""
    cmd = sub.add_parser(
        "bench", help="decode tok/s vs the bandwidth roofline: a shape against transformers (GPU), or a config's stack"
    )
    cmd.add_argument("--shape", help="comma-separated model shapes with random weights, e.g. qwen3-8b,qwen3-32b")
    cmd.add_argument("--config", help="a config whose stack is measured as configured")
    cmd.add_argument("--batch", default="1,4,16", help="comma-separated batch sizes (default 1,4,16)")
    cmd.add_argument("--prompt-tokens", type=_positive_int, default=128)
    cmd.add_argument("--new-tokens", type=_positive_int, default=256)
    cmd.add_argument(
        "--dtype", default="bfloat16", choices=["bfloat16", "float16", "fp8"], help="fp8: also runs bf16 to compare"
    )
    cmd.add_argument("--no-baseline", action="store_true", help="skip transformers' eager generate")
    cmd.add_argument(
        "--tensor-parallel",
        type=_positive_int,
        default=1,
        help="--shape: GPUs each shape is sharded over (no baseline then)",
    )
    cmd.add_argument("--json", action="store_true", help="print the rows as JSON instead of a table")
    cmd.add_argument("--plot", help="write a tok/s-vs-batch chart (PNG) here")
    cmd.add_argument("overrides", nargs="*", help="config overrides for --config")
    cmd.set_defaults(run=_bench)


def _add_eval(sub: Any) -> None:
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
        task.add_argument("--limit", type=_positive_int, help="only the first N problems")
        task.add_argument("--data", help=f"{data} (default: the copy shipped in evals/data, else the hub)")
        task.add_argument("--task", help=f"task settings YAML (default evals/{name}.yaml)")
        task.add_argument("--out", help=f"folder for per-sample records and the summary (default runs/eval/{name})")
        task.add_argument("--json", action="store_true", help="print the summary as JSON")
        task.add_argument("--plot", action="store_true", help="draw accuracy vs tok/s (needs matplotlib)")
        if name == "humaneval":
            task.add_argument("--samples", action="append", help="score completions from a jsonl (task_id, completion)")
            task.add_argument("--workers", type=_positive_int, help="programs run in parallel (default: CPU count)")
            task.add_argument("--isolation", default="auto", choices=["auto", "namespaces", "landlock", "rlimits"])
        task.add_argument("overrides", nargs="*", help="config overrides (task.KEY=VALUE for task settings)")
        task.set_defaults(run=_eval)


def _add_serve(sub: Any) -> None:
    """`hsmc serve --config X [--host H] [--port P] ... [key=value ...]` (see hsmc/serve/)."""
    cmd = sub.add_parser("serve", help="serve the config's stack over an OpenAI-compatible HTTP API")
    cmd.add_argument("--config", required=True, help="YAML config (e.g. configs/demo.yaml)")
    cmd.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    cmd.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    cmd.add_argument(
        "--max-queue",
        type=_positive_int,
        default=256,
        help="requests waiting for rows past which new ones get 429 (default 256)",
    )
    cmd.add_argument("--served-model-name", help="the model name clients send (default: the top level's model)")
    cmd.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM / Ctrl-C, seconds running requests get to finish before they are cancelled (default 30)",
    )
    cmd.add_argument("overrides", nargs="*", help="config overrides, e.g. engine.max_batch_rows=64")
    cmd.set_defaults(run=_serve)


def _add_tune_kernels(sub: Any) -> None:
    cmd = sub.add_parser(
        "tune-kernels", help="measure this GPU's kernel choices for the Qwen3 Linears and write its tuning file"
    )
    cmd.add_argument("--out", help="the file to write (default: this GPU's file in the package, hsmc/ops/tuning/)")
    cmd.add_argument(
        "--tensor-parallel", default="1", help="comma-separated TP sizes whose sharded Linears to tune too (e.g. 1,2)"
    )
    cmd.set_defaults(run=_tune_kernels, overrides=[])


SUBCOMMANDS: tuple[Callable[[Any], None], ...] = (
    _add_generate,
    _add_train_eagle,
    _add_bench,
    _add_eval,
    _add_serve,
    _add_tune_kernels,
)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hsmc", description="Hierarchical speculative decoding")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse gives a `*` positional only its first run of values: later overrides arrive here
    unknown = [a for a in extra if a.startswith("-") or "=" not in a]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)} - config overrides are key=value")
    args.overrides = [*args.overrides, *extra]
    try:
        return args.run(args)
    except HsmcError as e:
        message = " ".join(line.strip() for line in str(e).splitlines())  # a library's text may wrap
        print(f"hsmc: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        print(f"hsmc: interrupted{f'; {e}' if str(e) else ''}", file=sys.stderr)
        return 130


def _train_eagle(args: argparse.Namespace) -> int:
    from hsmc.training.trainer import load_train_config, train_eagle

    train_eagle(load_train_config(args.config, args.overrides))
    return 0


def _eval(args: argparse.Namespace) -> int:
    from hsmc.evals.command import run_eval

    run_eval(args)
    return 0


def _positive_int(text: str) -> int:
    """argparse type of a count: argparse's error line names the option ("--limit -3" would drop the last 3)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"takes an integer >= 1, got {text!r}")
    return value


def _positive_ints(text: str, option: str) -> list[int]:
    """A comma-separated list of positive integers (`1,4,16`), or one error line naming `option`."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise HsmcError(f"{option} takes comma-separated integers, got {text!r}") from None
    if min(values) < 1:
        raise HsmcError(f"{option} takes integers >= 1, got {text!r}")
    return values


def _tune_kernels(args: argparse.Namespace) -> int:
    from hsmc.ops.tune_kernels import default_path, tune_kernels

    if args.overrides:
        raise HsmcError(f"tune-kernels takes no config overrides, got {' '.join(args.overrides)}")
    sizes = _positive_ints(args.tensor_parallel, "tune-kernels: --tensor-parallel")
    tuning, text = tune_kernels(sizes)
    out = Path(args.out) if args.out else default_path()
    out.write_text(text)
    print(f"{tuning.device_name} (sm_{''.join(map(str, tuning.capability))}): wrote {out}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    import torch

    from hsmc.bench import plot, run_bench, to_json
    from hsmc.config import load_config
    from hsmc.models.shapes import SHAPES

    shapes = [s for s in (args.shape or "").split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown or not (shapes or args.config):
        raise HsmcError(f"bench: pass --config or --shape with one of {', '.join(SHAPES)} (got {unknown or 'none'})")
    if shapes and not torch.cuda.is_available():
        raise HsmcError("hsmc bench --shape measures GPU decode speed and needs a CUDA device")
    batches = _positive_ints(args.batch, "bench: --batch")
    config = load_config(args.config, args.overrides) if args.config else None
    engine = {
        "max_batch_rows": max(batches),
        "kv_capacity_tokens": max(batches) * (args.prompt_tokens + args.new_tokens + 64),
        "tensor_parallel": args.tensor_parallel,
    }
    name = Path(args.config).stem if args.config else "config"
    rows, table = run_bench(
        shapes, config, batches, args.prompt_tokens, args.new_tokens, args.dtype, not args.no_baseline, engine, name
    )
    print(to_json(rows) if args.json else table)
    if args.plot:
        plot(rows, Path(args.plot))
    return 0


def _serve(args: argparse.Namespace) -> int:
    from hsmc.config import load_config
    from hsmc.decoder import HierarchicalDecoder
    from hsmc.errors import KVCapacityError
    from hsmc.preflight import check_before_loading
    from hsmc.serve.server import serve

    if args.max_queue < 1 or args.shutdown_timeout < 0:
        raise HsmcError("serve: --max-queue must be at least 1 and --shutdown-timeout at least 0")
    cfg = load_config(args.config, [*args.overrides, "engine.warmup=true"])  # the KV budget leaves room for it
    try:  # the levels' files and the stop strings, before minutes of loading
        check_before_loading(cfg, [[0]])
    except KVCapacityError as e:
        raise KVCapacityError(f"serve: a one-token prompt with generation.max_new_tokens does not fit: {e}") from None
    decoder = HierarchicalDecoder(cfg)
    name = args.served_model_name or cfg.levels[-1].model
    serve(decoder, name, args.host, args.port, args.max_queue, args.shutdown_timeout)
    return 0


def _generate(args: argparse.Namespace) -> int:
    from hsmc.config import load_config
    from hsmc.decoder import GenerationInterrupted, HierarchicalDecoder
    from hsmc.preflight import check_before_loading

    cfg = load_config(args.config, args.overrides)
    prompts = _read_prompts(args, cfg.prompts)
    ids = check_before_loading(cfg, prompts)  # everything that can fail before minutes of loading
    load_start = time.perf_counter()
    decoder = HierarchicalDecoder(cfg)
    load_seconds = time.perf_counter() - load_start
    results: dict[int, Any] = {}
    try:
        if args.stream:
            _print_stream(decoder, prompts, ids, args.json, results)
        else:
            progress = _Progress(len(prompts), cfg.generation.max_new_tokens)
            with progress.bar:
                results.update(
                    enumerate(decoder.generate(ids, on_finish=progress.on_finish, on_progress=progress.on_progress))
                )
    except GenerationInterrupted as e:
        results.update(e.results)
        interrupted: KeyboardInterrupt | None = e
    except KeyboardInterrupt:  # while streaming: the finished prompts were collected as they came
        interrupted = KeyboardInterrupt(f"{len(results)} of {len(prompts)} prompts finished")
    else:
        interrupted = None
    finally:
        decoder.close()  # cancelled requests end and the decode loop stops before the process exits
    if args.json and not args.stream:
        for i, result in sorted(results.items()):
            print(json.dumps({"index": i, "prompt": prompts[i], **dataclasses.asdict(result)}))
    elif not args.json:
        _print_results(prompts, results, decoder, load_seconds, completions=not args.stream)
    if interrupted is not None:
        raise KeyboardInterrupt(f"{interrupted}; their completions and stats are printed above") from None
    return 0


def _print_stream(decoder: Any, prompts: list[Any], ids: list[list[int]], as_json: bool, results: dict) -> None:
    """Print each prompt's text as it settles, prompt after prompt (text of a later prompt that settles early
    waits for its turn); with `as_json` every increment as it comes, one JSON line each, the result on the
    last. Finished prompts are collected in `results`; the level stats of the run are added once all have ended."""
    waiting, shown = [""] * len(prompts), 0
    start = time.perf_counter()
    if not as_json:
        print(f"### {prompts[0]}", flush=True)
    try:
        for increment in decoder.stream(ids):
            i = increment.index
            if increment.result is not None:
                results[i] = increment.result
            if as_json:
                result = dataclasses.asdict(increment.result) if increment.result else None
                line = {"index": i, "text": increment.text, "token_ids": increment.token_ids, "result": result}
                print(json.dumps(line))
                continue
            waiting[i] += increment.text
            while shown < len(prompts):
                print(waiting[shown], end="", flush=True)
                waiting[shown] = ""
                if shown not in results:
                    break
                shown += 1
                print("\n" + (f"\n### {prompts[shown]}" if shown < len(prompts) else ""), flush=True)
    finally:
        levels = decoder.level_stats(time.perf_counter() - start)
        for result in results.values():
            result.stats["levels"] = levels


def _read_prompts(args: argparse.Namespace, default: list[str]) -> list[Any]:
    from hsmc.prompts import read_prompts_file

    if args.prompt is not None:
        return [args.prompt]
    if args.prompts_file is not None:
        return read_prompts_file(args.prompts_file)
    if not default:
        raise PromptError("no prompts: pass --prompt, --prompts-file, or set `prompts` in the config")
    return list(default)


class _Progress:
    """Progress on stderr: for one prompt its tokens (tok/s and live level statistics), else finished prompts."""

    _LIVE_STATS = {"mean_accepted_length": "accepted", "mean_ess_fraction": "ess"}

    def __init__(self, num_prompts: int, max_new_tokens: int) -> None:
        from tqdm import tqdm

        self.single = num_prompts == 1
        total, unit = (max_new_tokens, "tok") if self.single else (num_prompts, "prompt")
        self.bar = tqdm(total=total, unit=unit, desc="tokens" if self.single else "prompts", file=sys.stderr)

    def on_finish(self, index: int) -> None:
        if not self.single:
            self.bar.update()

    def on_progress(self, increment: Any) -> None:
        """The request's tokens so far and its own level statistics, as the decode loop read them."""
        if not self.single or increment.generated <= self.bar.n:
            return
        live = {
            f"{self._LIVE_STATS[key]}{i}": f"{value:.2f}"
            for i, level in enumerate(increment.levels)
            for key, value in level.items()
            if key in self._LIVE_STATS
        }
        self.bar.set_postfix(live, refresh=False)
        self.bar.update(increment.generated - self.bar.n)


def _print_results(
    prompts: list[Any], results: dict[int, Any], decoder: Any, load_seconds: float, completions: bool = True
) -> None:
    """Completions (unless streamed already), then a stats row per prompt and per level (README: "Reading
    the stats")."""
    if not results:
        return
    for i, r in sorted(results.items()) if completions else ():
        completion = r.text if decoder.tokenizer is not None else f"token ids: {r.token_ids}"
        print(f"### {prompts[i]}\n{completion}\n")
    total_tokens = sum(r.stats["new_tokens"] for r in results.values())
    seconds = max(r.stats["seconds"] for r in results.values())
    print(f"{'prompt':>6} {'new tokens':>10} {'finish':>7} {'seconds':>8} {'tok/s':>8}")
    for i, r in sorted(results.items()):
        s = r.stats
        print(f"{i:>6} {s['new_tokens']:>10} {r.finish_reason:>7} {s['seconds']:>8.2f} {s['tokens_per_s']:>8.1f}")
    print(f"{'total':>6} {total_tokens:>10} {'':>7} {seconds:>8.2f} {total_tokens / seconds:>8.1f}")
    print(
        f"\n{'level':<10} {'model':<28} {'time':>5}  stats"
        f"   (device {decoder.config.engine.device}, load {load_seconds:.1f}s)"
    )
    for level in max(results.values(), key=lambda r: r.stats["seconds"]).stats["levels"]:
        extra = ", ".join(
            f"{k} {v}" if isinstance(v, int) else f"{k} {v:.2f}"
            for k, v in level.items()
            if k not in ("kind", "model", "share_of_time")
        )
        print(f"{level['kind']:<10} {level['model'][-28:]:<28} {level['share_of_time']:>5.0%}  {extra}")


if __name__ == "__main__":
    sys.exit(main())
