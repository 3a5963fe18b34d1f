"""When a row stops: a stop token (EOS unless ignored) or a stop string in the decoded text."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


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


def output_ends(
    tokens: torch.Tensor, generated: torch.Tensor, stop_ids: torch.Tensor, max_new_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`StopCriteria.append` without stop strings, on the device: of each row's new tokens [R, W], how many
    belong to the output (up to and including the first stop token, within max_new_tokens given `generated`
    [R] so far), and whether the output ends with them: (kept int64 [R], ends bool [R])."""
    width = tokens.shape[1]
    room = (max_new_tokens - generated).clamp(0, width)
    positions = torch.arange(width, device=tokens.device)
    stops = torch.isin(tokens, stop_ids) & (positions[None, :] < room[:, None])
    first = torch.where(stops, positions[None, :], width).amin(-1)
    stopped = first < width
    kept = torch.where(stopped, first + 1, room)
    return kept, stopped | (generated + kept >= max_new_tokens)
