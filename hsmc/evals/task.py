"""What the runner needs from a task: items with prompts and references, and a scorer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class Item:
    id: str
    prompt: str
    reference: str  # the expected answer (GSM8K) or the task id whose tests decide (HumanEval)


@dataclass
class Scored:
    extracted: str | None  # what was scored: the number, or the program's code
    correct: bool
    detail: dict[str, Any] = field(default_factory=dict)  # e.g. why a program failed


class Task(Protocol):
    name: str
    items: list[Item]
    generation_overrides: dict[str, Any]  # passed to HierarchicalDecoder.generate (chat_template, stop)

    def meta(self) -> dict[str, Any]:
        """Settings that must match for a record file to be resumed."""
        ...

    def score(self, items: list[Item], outputs: list[str]) -> list[Scored]: ...
