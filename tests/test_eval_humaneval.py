"""HumanEval: the 164 canonical solutions pass through the sandbox and a corrupted copy of each fails; code
extraction from chat replies; scoring a samples file with the CLI, without a model."""

from __future__ import annotations

import json

import pytest

from hsmc.cli import main
from hsmc.evals.humaneval import (
    HumanEvalSettings,
    HumanEvalTask,
    completion_from_code,
    extract_code,
    load_problems,
)
from hsmc.evals.sandbox import Sandbox

# Wraps the entry point so that every result is wrong in a way of its own type.
CORRUPTION = """

def _corrupt(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "#"
    if isinstance(value, (list, tuple)):
        return type(value)([*value, "#"])
    if value is None:
        return "#"
    return ("#", value)


_original = {entry_point}


def {entry_point}(*args, **kwargs):
    return _corrupt(_original(*args, **kwargs))
"""


@pytest.fixture(scope="module")
def task() -> HumanEvalTask:
    return HumanEvalTask(HumanEvalSettings(), Sandbox())


@pytest.mark.slow  # 328 sandboxed programs: about 30 s on 2 CPU cores
def test_all_canonical_solutions_pass_and_corrupted_ones_fail(task):
    problems = task.problems
    assert len(problems) == 164
    ids = list(problems)
    canonical = [problems[t]["canonical_solution"] for t in ids]
    corrupted = [c + CORRUPTION.format(entry_point=problems[t]["entry_point"]) for t, c in zip(ids, canonical)]
    scored = task.run_completions(ids + ids, canonical + corrupted)
    passed = [t for t, s in zip(ids, scored[:164]) if s.correct]
    assert len(passed) == 164, [(t, s.detail) for t, s in zip(ids, scored[:164]) if not s.correct]
    assert [t for t, s in zip(ids, scored[164:]) if s.correct] == []


def test_code_extraction_from_chat_replies():
    reply = "Sure!\n```python\nimport math\n\ndef f(x):\n    return math.sqrt(x)\n```\nDone."
    assert extract_code(reply, "f") == "import math\n\ndef f(x):\n    return math.sqrt(x)\n"
    two = "```\nprint('example')\n```\nthen\n```py\ndef g(x):\n    return 1\n```"
    assert extract_code(two, "g") == "def g(x):\n    return 1\n"  # the block that defines the entry point
    assert extract_code(two, "h") == "print('example')\n"  # else the first block
    assert extract_code("```python\ndef f(x):\n    return 2", "f") == "def f(x):\n    return 2"  # cut off
    assert extract_code("    return x + 1\n", "f") == "    return x + 1\n"  # no fence: the whole reply


def test_completion_is_a_full_definition_or_a_body():
    assert completion_from_code("def f(x):\n    return 1\n", "f") == "\ndef f(x):\n    return 1\n"
    assert completion_from_code("    return 1\n", "f") == "    return 1\n"


def test_chat_and_completion_prompts(task):
    problem = task.problems["HumanEval/0"]
    assert task.items[0].prompt == HumanEvalSettings().chat_template.format(prompt=problem["prompt"])
    assert task.generation_overrides == {}
    base = HumanEvalTask(HumanEvalSettings(prompt_style="completion"), task.sandbox, limit=2)
    assert [i.prompt for i in base.items] == [task.problems[t]["prompt"] for t in ("HumanEval/0", "HumanEval/1")]
    assert base.generation_overrides["chat_template"] is False and "\ndef" in base.generation_overrides["stop"]


def test_a_chat_reply_is_scored_against_the_problem(task):
    problem = task.problems["HumanEval/2"]  # truncate_number
    reply = f"Here it is:\n```python\n{problem['prompt']}{problem['canonical_solution']}```"
    wrong = "```python\ndef truncate_number(number: float) -> float:\n    return number\n```"
    scored = task.score(task.items[2:3] * 2, [reply, wrong])
    assert [s.correct for s in scored] == [True, False]


def test_samples_file_is_scored_without_a_model(tmp_path, capsys):
    problems, _ = load_problems(None)
    samples = tmp_path / "samples.jsonl"
    lines = [{"task_id": t, "completion": problems[t]["canonical_solution"]} for t in list(problems)[:3]]
    lines.append({"task_id": "HumanEval/0", "completion": "    return True\n"})  # a second, wrong sample
    samples.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out"
    argv = ["eval", "humaneval", "--samples", str(samples), "--limit", "3", "--out", str(out), "--json"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out)
    assert summary["sandbox"].startswith(Sandbox().isolation) and f"sandbox: {summary['sandbox']}" in captured.err
    (config,) = summary["configs"]
    assert (config["n"], config["correct"]) == (4, 3)
    records = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()[1:]]
    assert [r["id"] for r in records] == ["HumanEval/0#0", "HumanEval/1#0", "HumanEval/2#0", "HumanEval/0#1"]
    assert records[3]["correct"] is False and records[3]["detail"]["reason"].startswith("AssertionError")


def test_bad_samples_file_is_one_clear_error(tmp_path, capsys):
    samples = tmp_path / "s.jsonl"
    samples.write_text('{"task_id": "HumanEval/999", "completion": ""}\n')
    assert main(["eval", "humaneval", "--samples", str(samples), "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.strip().endswith(f"hsmc: error: {samples}:1: unknown task_id 'HumanEval/999'")
