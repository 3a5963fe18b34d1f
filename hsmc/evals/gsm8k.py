"""GSM8K: grade-school math word problems, scored by the final number of the answer.

The prompt (zero-shot chat, optionally k-shot from the train split) is kept in `evals/gsm8k.yaml`.
Data: a local jsonl with `question`/`answer` (the repo ships the MIT-licensed splits in `evals/data/`)
or a `datasets` hub id (`openai/gsm8k`, config `main`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from hsmc.errors import HsmcError
from hsmc.evals.settings import EVALS_DIR
from hsmc.evals.task import Item, Scored

HUB_ID = "openai/gsm8k"
LOCAL_SPLITS = {"test": EVALS_DIR / "data" / "gsm8k_test.jsonl", "train": EVALS_DIR / "data" / "gsm8k_train.jsonl"}
# A number: optional sign and "$", digits with thousands commas, optional decimals. The look-behind keeps the
# "-" of a range like "5-6" and the digits of a decimal's fraction from starting a number of their own.
_NUMBER = re.compile(r"(?<![\d.,])(-?)\$?(-?)(\d(?:[\d,]*\d)?(?:\.\d+)?)")
_FINAL = re.compile(r"####\s*(?:[^\d\n$-]{0,20}?)(-?\$?-?\d(?:[\d,]*\d)?(?:\.\d+)?)")
_CALCULATOR = re.compile(r"<<[^>]*>>")


@dataclass
class Gsm8kSettings:
    template: str = "{question}"  # the user turn; {question} is replaced
    shots: int = 0  # solved training problems shown before the question
    shot_template: str = "Question: {question}\nAnswer: {answer}\n\n"
    max_new_tokens: int = 256  # the default of generation.max_new_tokens for this task


def normalize_number(text: str) -> Decimal | None:
    """`-$1,234.50` -> Decimal('-1234.50'); None when `text` is not a number."""
    cleaned = text.replace(",", "").replace("$", "").strip()
    negative = cleaned.count("-") == 1
    cleaned = cleaned.replace("-", "")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    return -value if negative else value


def extract_answer(text: str) -> str | None:
    """The answer in a model output: the number after the last `####`, else the last number; canonical form
    (no commas, no `$`, no trailing zeros after the point: `1,000.00` -> `1000`), or None when there is none."""
    finals = _FINAL.findall(text)
    if finals:
        value = normalize_number(finals[-1])
    else:
        numbers = _NUMBER.findall(text)
        value = normalize_number("".join(numbers[-1])) if numbers else None
    return None if value is None else canonical(value)


def canonical(value: Decimal) -> str:
    text = format(value.normalize(), "f")
    return "0" if text in ("-0", "0") else text


def reference_answer(answer_field: str) -> str:
    """GSM8K's own answer: the text after `####` in the `answer` field, as a canonical number."""
    value = normalize_number(answer_field.rsplit("####", 1)[-1])
    if value is None:
        raise HsmcError(f"GSM8K answer field has no number after '####': {answer_field[-80:]!r}")
    return canonical(value)


def answers_match(extracted: str | None, reference: str) -> bool:
    return extracted is not None and Decimal(extracted) == Decimal(reference)


def load_rows(source: str | None, split: str = "test") -> tuple[list[dict[str, Any]], str]:
    """GSM8K rows and a description of where they came from: `source` is a jsonl path or a `datasets` id;
    None means the copy shipped in the repo, or the hub when the repo's copy is missing."""
    if source is None:
        source = str(LOCAL_SPLITS[split]) if LOCAL_SPLITS[split].is_file() else HUB_ID
    path = Path(source)
    if path.suffix == ".jsonl" or path.exists():
        if not path.is_file():
            raise HsmcError(f"--data: no such file {path}")
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        missing = [i for i, r in enumerate(rows) if not {"question", "answer"} <= r.keys()]
        if missing:
            raise HsmcError(f"{path}: line {missing[0] + 1} lacks a 'question' or 'answer' field")
        return rows, str(path)
    try:
        from datasets import load_dataset

        dataset = load_dataset(source, "main", split=split)
    except Exception as e:  # the hub, the network or the id: datasets raises many kinds
        raise HsmcError(f"--data {source}: cannot load it with datasets ({type(e).__name__}: {e})") from None
    return [dict(r) for r in dataset], f"{source} (datasets, main, {split})"


class Gsm8kTask:
    """Prompts and scoring for one run over GSM8K questions."""

    name = "gsm8k"

    def __init__(self, settings: Gsm8kSettings, data: str | None = None, limit: int | None = None) -> None:
        self.settings = settings
        rows, self.source = load_rows(data, "test")
        rows = rows[:limit] if limit is not None else rows
        prefix = ""
        if settings.shots > 0:
            train, _ = load_rows(None if data is None or Path(data).exists() else data, "train")
            prefix = "".join(
                settings.shot_template.format(question=r["question"], answer=_CALCULATOR.sub("", r["answer"]))
                for r in train[: settings.shots]
            )
        self.items = [
            Item(
                id=f"gsm8k/test/{i}",
                prompt=prefix + settings.template.format(question=r["question"]),
                reference=reference_answer(r["answer"]),
            )
            for i, r in enumerate(rows)
        ]
        self.generation_overrides: dict[str, Any] = {}

    def meta(self) -> dict[str, Any]:
        return {"task": self.name, "data": self.source, "settings": vars(self.settings)}

    def score(self, items: list[Item], outputs: list[str]) -> list[Scored]:
        scored = []
        for item, output in zip(items, outputs):
            extracted = extract_answer(output)
            scored.append(Scored(extracted=extracted, correct=answers_match(extracted, item.reference)))
        return scored
