"""Prompt files: a text file holds one prompt per non-blank line; a `.jsonl` file holds one JSON
object per line whose `field` is a prompt (a string, or a list of token ids for a model without a
tokenizer). A bad line is reported with the file and its line number."""

from __future__ import annotations

import json
from pathlib import Path

from hsmc.errors import PromptError

Prompt = str | list[int]


def read_prompts_file(path: str | Path, field: str = "prompt", option: str = "--prompts-file") -> list[Prompt]:
    """The prompts in `path`; `option` names the setting that gave the path, for the error messages."""
    path = Path(path)
    if not path.is_file():
        raise PromptError(f"{option}: no such file {path}")
    lines = [(n, line) for n, line in enumerate(path.read_text().splitlines(), start=1) if line.strip()]
    if path.suffix == ".jsonl":
        prompts = [_jsonl_prompt(path, n, line, field) for n, line in lines]
    else:
        prompts = [line for _, line in lines]
    if not prompts:
        raise PromptError(f"{option}: {path} holds no prompts")
    return prompts


def _jsonl_prompt(path: Path, n: int, line: str, field: str) -> Prompt:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise PromptError(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(row, dict) or field not in row:
        keys = f"keys: {', '.join(sorted(row))}" if isinstance(row, dict) else f"a {type(row).__name__}"
        raise PromptError(f"{path}:{n}: no {field!r} field ({keys})")
    prompt = row[field]
    is_ids = isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    if not isinstance(prompt, str) and not is_ids:
        raise PromptError(f"{path}:{n}: {field!r} must be a string or a list of token ids, got {prompt!r:.60}")
    return prompt
