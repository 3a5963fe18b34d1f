"""Where the eval task settings and shipped data live: the repository's `evals/` folder."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TypeVar

from hsmc.config import load_structured
from hsmc.errors import HsmcError

T = TypeVar("T")
EVALS_DIR = Path(__file__).resolve().parents[2] / "evals"


def load_task_settings(schema: type[T], name: str, path: str | Path | None, overrides: Sequence[str]) -> T:
    """`schema` from `path` (default `evals/<name>.yaml`) plus `key=value` overrides (`task.` prefix removed)."""
    source = Path(path) if path is not None else EVALS_DIR / f"{name}.yaml"
    if not source.is_file():
        raise HsmcError(f"task settings {source} not found (pass --task FILE, or run from an hsmc source checkout)")
    return load_structured(schema, source, [o.removeprefix("task.") for o in overrides])
