"""Tokenizer and chat template through transformers; prompts may also arrive as token ids."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hsmc.errors import PromptError

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_tokenizer(folder: Path, gguf_file: str | None = None) -> Any | None:
    """The folder's tokenizer, or None when it ships no tokenizer files (prompts are then token ids)."""
    from transformers import AutoTokenizer

    if gguf_file is None and not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)


def encode_prompt(tokenizer: Any | None, prompt: str | Sequence[int], chat_template: bool) -> list[int]:
    """Token ids for one prompt: ids pass through untouched; text is wrapped as a user turn of the
    chat template (with the assistant prefix) when `chat_template` is set and the tokenizer has one."""
    if not isinstance(prompt, str):
        return [int(t) for t in prompt]
    if tokenizer is None:
        raise PromptError(
            "this model has no tokenizer files: pass prompts as lists of token ids "
            '(on the command line, a .jsonl prompts file with lines like {"prompt": [1, 2, 3]})'
        )
    if chat_template and tokenizer.chat_template:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt)["input_ids"]
