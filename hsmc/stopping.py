"""When a row stops: a stop token (EOS unless ignored) or a stop string in the decoded text."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StopCriteria:
    token_ids: frozenset[int]
    strings: tuple[str, ...] = ()
    tokenizer: Any | None = None

    def first_stop(self, generated: list[int], start: int) -> int | None:
        """Smallest length L > start at which generated[:L] has stopped, or None.

        Stop strings are searched in the decoded tail around each new token (a window long
        enough for the longest string), so a check costs O(new tokens), not O(text).
        """
        window = 4 * max((len(s) for s in self.strings), default=0) + 8
        for length in range(start + 1, len(generated) + 1):
            if generated[length - 1] in self.token_ids:
                return length
            if self.strings:
                tail = self.tokenizer.decode(generated[max(0, length - window) : length])
                head = self.tokenizer.decode(generated[max(0, length - window) : length - 1])
                if any(s in tail and s not in head for s in self.strings):
                    return length
        return None

    def append(self, generated: list[int], new: list[int], max_new_tokens: int) -> str | None:
        """Append `new` to `generated` up to the output's end; returns the finish reason ("stop", "length") if
        these tokens ended it, else None. Tokens run up to the one that stops (it is kept)."""
        before = len(generated)
        generated += new[: max_new_tokens - before]
        cut = self.first_stop(generated, before)
        if cut is not None:
            del generated[cut:]
            return "stop"
        return "length" if len(generated) == max_new_tokens else None

    def trim(self, text: str) -> str:
        """The text up to (not including) the first stop string."""
        cut = min((i for i in (text.find(s) for s in self.strings) if i >= 0), default=len(text))
        return text[:cut]
