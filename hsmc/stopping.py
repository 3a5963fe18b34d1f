"""When a row stops: a stop token (EOS unless ignored) or a stop string in the decoded text."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StopCriteria:
    token_ids: frozenset[int]
    strings: tuple[str, ...] = ()
    tokenizer: Any | None = None
    # sees len(generated) at every check: the decode loops check each row's new tokens here, so
    # this is their progress signal (a single prompt's progress bar)
    on_check: Callable[[int], None] | None = None

    def first_stop(self, generated: list[int], start: int) -> int | None:
        """Smallest length L > start at which generated[:L] has stopped, or None.

        Stop strings are searched in the decoded tail around each new token (a window long
        enough for the longest string), so a check costs O(new tokens), not O(text).
        """
        if self.on_check:
            self.on_check(len(generated))
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

    def trim(self, text: str) -> str:
        """The text up to (not including) the first stop string."""
        cut = min((i for i in (text.find(s) for s in self.strings) if i >= 0), default=len(text))
        return text[:cut]
