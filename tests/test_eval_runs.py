"""`hsmc eval` end to end on tiny random models with a tiny word-level tokenizer: lossless stacks give the
same answers, interrupted runs resume to the same summary, the CLI writes records, summaries and JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import make_tiny_model

from hsmc.cli import main
from hsmc.decoder import HierarchicalDecoder
from hsmc.evals.gsm8k import Gsm8kSettings, Gsm8kTask
from hsmc.evals.report import compare, summarize
from hsmc.evals.runner import evaluate_config

WORDS = ["<unk>", "<s>", "</s>", "####", "$", ",", "."] + [str(d) for d in range(10)]


def make_tiny_tokenizer(folder: Path, vocab_size: int = 101) -> Path:
    """A word-level tokenizer over digits, '####' and filler words, with a one-line chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = WORDS + [f"w{i}" for i in range(vocab_size - len(WORDS))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = (
        "{% for m in messages %}<s> {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w1 {% endif %}"
    )
    fast.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny llama target and a tiny llama draft (another seed), both with the word-level tokenizer."""
    root = tmp_path_factory.mktemp("eval-models")
    target = make_tiny_tokenizer(make_tiny_model("llama", root / "target", seed=0))
    draft = make_tiny_tokenizer(make_tiny_model("llama", root / "draft", seed=1))
    return target, draft


def write_config(path: Path, levels: list[dict], max_batch_rows: int = 2) -> str:
    config = {
        "levels": levels,
        "generation": {"seed": 3},
        "engine": {"device": "cpu", "max_batch_rows": max_batch_rows, "kv_capacity_tokens": 512},
    }
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.fixture(scope="module")
def short_gsm8k(tmp_path_factory) -> str:
    """The first GSM8K test items with their questions cut to 8 words: tiny models need no long prompts."""
    from hsmc.evals.gsm8k import load_rows

    rows, _ = load_rows(None)
    path = tmp_path_factory.mktemp("data") / "short.jsonl"
    path.write_text(
        "".join(json.dumps({**r, "question": " ".join(r["question"].split()[:8])}) + "\n" for r in rows[:8])
    )
    return str(path)


def gsm8k_task(data: str, limit: int) -> Gsm8kTask:
    return Gsm8kTask(Gsm8kSettings(template="{question} #### ", max_new_tokens=12), data=data, limit=limit)


def test_lossless_level_gives_identical_answers(tiny_pair, short_gsm8k, tmp_path):
    """[target] vs [draft, rejection target] at temperature 0: the rejection level is lossless, so every
    sample's output and extracted answer are the same."""
    target, draft = tiny_pair
    alone = write_config(tmp_path / "alone.yaml", [{"kind": "model", "model": str(target)}])
    stacked = write_config(
        tmp_path / "stacked.yaml",
        [
            {"kind": "model", "model": str(draft)},
            {"kind": "rejection", "model": str(target), "num_draft_tokens": 3},
        ],
    )
    task = gsm8k_task(short_gsm8k, limit=6)
    overrides = ["generation.max_new_tokens=12"]
    a = evaluate_config(task, alone, overrides, tmp_path / "out" / "alone.jsonl")
    b = evaluate_config(task, stacked, overrides, tmp_path / "out" / "stacked.jsonl")
    assert [r["output"] for r in a] == [r["output"] for r in b]
    assert [r["extracted"] for r in a] == [r["extracted"] for r in b]
    assert sum(r["extracted"] is not None for r in a) >= 3  # the outputs do contain numbers to compare
    summaries = [summarize("alone", alone, a), summarize("stacked", stacked, b)]
    compare(summaries, [a, b])
    assert summaries[1].difference == 0 and summaries[1].p_value == 1.0 and summaries[1].within_noise
    assert summaries[1].same_answers == 1.0
    assert summaries[1].mean_accepted_length is not None and summaries[0].mean_accepted_length is None


def _summary_without_timing(records: list[dict]) -> dict:
    s = vars(summarize("x", "c", records))
    return {k: v for k, v in s.items() if k not in ("generate_seconds", "tokens_per_s")}


def test_interrupted_run_resumes_to_the_same_summary(tiny_pair, short_gsm8k, tmp_path, monkeypatch):
    """Sampling at temperature 1 (so the seed matters): a run killed after its second chunk, then resumed,
    has the same records and summary as an uninterrupted run."""
    target, _ = tiny_pair
    config = write_config(tmp_path / "t.yaml", [{"kind": "model", "model": str(target), "temperature": 1.0}])
    task = gsm8k_task(short_gsm8k, limit=7)
    overrides = ["generation.max_new_tokens=12"]
    whole = evaluate_config(task, config, overrides, tmp_path / "whole" / "t.jsonl")

    generate = HierarchicalDecoder.generate
    calls = []

    def interrupted(self, prompts, **kwargs):
        calls.append(len(prompts))
        if len(calls) == 3:
            raise KeyboardInterrupt
        return generate(self, prompts, **kwargs)

    monkeypatch.setattr(HierarchicalDecoder, "generate", interrupted)
    out = tmp_path / "resumed" / "t.jsonl"
    with pytest.raises(KeyboardInterrupt):
        evaluate_config(task, config, overrides, out)
    assert len(out.read_text().splitlines()) == 1 + 4  # header + two chunks of two
    with out.open("a") as f:
        f.write('{"id": "gsm8k/test/4", "outp')  # a torn write at the moment of the interruption
    monkeypatch.setattr(HierarchicalDecoder, "generate", generate)
    resumed = evaluate_config(task, config, overrides, out)
    assert [r["output"] for r in resumed] == [r["output"] for r in whole]
    assert _summary_without_timing(resumed) == _summary_without_timing(whole)
    assert len(out.read_text().splitlines()) == 1 + 7


def test_resuming_with_other_settings_is_refused(tiny_pair, short_gsm8k, tmp_path, capsys):
    target, _ = tiny_pair
    config = write_config(tmp_path / "t.yaml", [{"kind": "model", "model": str(target)}])
    out = tmp_path / "out"
    args = ["eval", "gsm8k", "--config", config, "--limit", "2", "--data", short_gsm8k, "--out", str(out)]
    args.append("generation.max_new_tokens=4")
    assert main(args) == 0
    records = (out / "t.jsonl").read_text()
    assert main([*args[:-1], "generation.max_new_tokens=5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("hsmc: error: ") and "t.jsonl was written by a run with other settings" in err[-1]
    assert "resolved" in err[-1]
    assert (out / "t.jsonl").read_text() == records  # nothing already computed is lost


def test_cli_compares_configs_and_prints_json(tiny_pair, short_gsm8k, tmp_path, capsys):
    target, draft = tiny_pair
    a = write_config(tmp_path / "alone.yaml", [{"kind": "model", "model": str(target)}])
    b = write_config(
        tmp_path / "spec.yaml",
        [{"kind": "model", "model": str(draft)}, {"kind": "rejection", "model": str(target)}],
    )
    out = tmp_path / "out"
    argv = ["eval", "gsm8k", "--config", a, "--config", b, "--limit", "4", "--data", short_gsm8k, "--out", str(out)]
    argv.append("--json")
    assert main([*argv, "task.max_new_tokens=6"]) == 0  # the task's default of generation.max_new_tokens
    summary = json.loads(capsys.readouterr().out)
    assert summary["task"] == "gsm8k" and [c["label"] for c in summary["configs"]] == ["alone", "spec"]
    assert all(c["n"] == 4 for c in summary["configs"])
    assert summary["configs"][1]["p_value"] == 1.0  # lossless at temperature 0: no discordant pair
    records = [json.loads(line) for line in (out / "alone.jsonl").read_text().splitlines()]
    meta, first = records[0]["meta"], records[1]
    assert meta["settings"]["max_new_tokens"] == 6 and meta["resolved"]["generation"]["max_new_tokens"] == 6
    question = json.loads(Path(short_gsm8k).read_text().splitlines()[0])["question"]
    assert first["prompt"] == meta["settings"]["template"].format(question=question)
    assert all(r["tokens"] <= 6 for r in records[1:])
    assert set(first) >= {"id", "output", "extracted", "correct", "tokens", "seconds", "levels"}
    assert json.loads((out / "summary.json").read_text()) == summary
    assert (out / "summary.md").read_text().startswith("| config | n | accuracy |")


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["eval", "gsm8k", "--limit", "2"]) == 2
    assert main(["eval", "gsm8k", "--config", "x.yaml", "--data", str(tmp_path / "none.jsonl")]) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q"}\n')
    assert main(["eval", "gsm8k", "--config", "x.yaml", "--data", str(bad)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line]
    assert err == [
        "hsmc: error: pass --config (one or more) to generate, or --samples FILE.jsonl to score completions",
        f"hsmc: error: --data: no such file {tmp_path / 'none.jsonl'}",
        f"hsmc: error: {bad}: line 1 lacks a 'question' or 'answer' field",
    ]


def test_humaneval_with_a_model_generates_completions_and_runs_them(tiny_pair, tmp_path, capsys):
    """The plumbing of a model run: completion prompts without chat template, stop strings, sandboxed scoring
    (a tiny random model writes no working code, so every problem fails with a reason)."""
    target, _ = tiny_pair
    config = write_config(tmp_path / "t.yaml", [{"kind": "model", "model": str(target)}])
    out = tmp_path / "out"
    argv = ["eval", "humaneval", "--config", config, "--limit", "2", "--out", str(out), "--json"]
    assert main([*argv, "task.prompt_style=completion", "task.max_new_tokens=3"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["configs"][0]["n"], summary["configs"][0]["correct"]) == (2, 0)
    records = [json.loads(line) for line in (out / "t.jsonl").read_text().splitlines()]
    assert records[0]["meta"]["settings"]["prompt_style"] == "completion"
    assert [r["id"] for r in records[1:]] == ["HumanEval/0", "HumanEval/1"]
    assert all(r["tokens"] <= 3 and r["detail"]["reason"] for r in records[1:])
    assert records[1]["extracted"] == records[1]["output"]  # a base model's text is the function body
