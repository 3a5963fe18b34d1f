"""`hsmc eval gsm8k|humaneval`: run each config (or score sample files), then summarize and compare."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from hsmc.errors import HsmcError
from hsmc.evals.report import ConfigSummary, compare, format_table, plot, summaries_json, summarize
from hsmc.evals.runner import evaluate_config


def run_eval(args: argparse.Namespace) -> None:
    task_overrides = [o for o in args.overrides if o.startswith("task.")]
    config_overrides = [o for o in args.overrides if not o.startswith("task.")]
    samples = getattr(args, "samples", None) or []
    if bool(args.config) == bool(samples):
        raise HsmcError("pass --config (one or more) to generate, or --samples FILE.jsonl to score completions")
    out = Path(args.out) if args.out else Path("runs") / "eval" / args.task_name
    extra: dict[str, Any] = {}
    if args.task_name == "gsm8k":
        from hsmc.evals.gsm8k import Gsm8kSettings, Gsm8kTask

        settings = load_settings(Gsm8kSettings, args, task_overrides)
        task = Gsm8kTask(settings, args.data, args.limit)
    else:
        from hsmc.evals.humaneval import HumanEvalSettings, HumanEvalTask
        from hsmc.evals.sandbox import Sandbox

        settings = load_settings(HumanEvalSettings, args, task_overrides)
        sandbox = Sandbox(settings.limits(), isolation=args.isolation, workers=args.workers)
        extra["sandbox"] = sandbox.describe()
        print(f"sandbox: {extra['sandbox']}", file=sys.stderr, flush=True)
        task = HumanEvalTask(settings, sandbox, args.data, args.limit)
    labels = _unique_labels(samples or args.config)
    if samples:
        from hsmc.evals.humaneval import score_samples

        records = [score_samples(task, Path(s), out / f"{label}.jsonl") for s, label in zip(samples, labels)]
    else:
        overrides = [f"generation.max_new_tokens={settings.max_new_tokens}", *config_overrides]
        records = [
            evaluate_config(task, config, overrides, out / f"{label}.jsonl", position=i)
            for i, (config, label) in enumerate(zip(args.config, labels))
        ]
    summaries = [summarize(label, src, rs) for label, src, rs in zip(labels, samples or args.config, records)]
    compare(summaries, records)
    _write_outputs(task.name, summaries, extra, out, args)


def load_settings(schema: type, args: argparse.Namespace, overrides: list[str]):
    from hsmc.evals.settings import load_task_settings

    return load_task_settings(schema, args.task_name, args.task, overrides)


def _unique_labels(paths: list[str]) -> list[str]:
    labels: list[str] = []
    for path in paths:
        stem, label, k = Path(path).stem, Path(path).stem, 2
        while label in labels:
            label, k = f"{stem}-{k}", k + 1
        labels.append(label)
    return labels


def _write_outputs(
    task: str, summaries: list[ConfigSummary], extra: dict[str, Any], out: Path, args: argparse.Namespace
) -> None:
    table = format_table(summaries)
    summary = summaries_json(task, summaries, extra)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "summary.md").write_text(table + "\n")
    if args.plot:
        plot(summaries, task, out / "accuracy_vs_speed.png")
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(table)
        print(f"\nrecords and summary in {out}/" + (f", plot {out / 'accuracy_vs_speed.png'}" if args.plot else ""))
