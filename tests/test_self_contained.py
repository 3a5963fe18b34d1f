"""The repository needs nothing beside it: no file a user runs or reads points outside it."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHECKED = ("hsmc", "configs", "scripts", "tests", "docs", "evals", ".ci")
OUTSIDE = "../" + "shared"  # built, so this file does not match itself


def _text_files() -> list[Path]:
    files = [REPO / "README.md", REPO / "pyproject.toml"]
    for folder in CHECKED:
        files += [p for p in (REPO / folder).rglob("*") if p.is_file() and p.suffix != ".jsonl"]
    return [p for p in files if "__pycache__" not in p.parts]


def test_no_file_refers_outside_the_repository():
    offenders = [
        str(p.relative_to(REPO)) for p in _text_files() if OUTSIDE in p.read_text(encoding="utf-8", errors="replace")
    ]
    assert offenders == []


def test_the_check_sees_the_files_it_guards():
    names = {str(p.relative_to(REPO)) for p in _text_files()}
    assert {"README.md", "hsmc/cli.py", "configs/demo.yaml", "scripts/bench_stacks.py", "docs/design.md"} <= names
