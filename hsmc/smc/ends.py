"""Where each particle's output ends within a cycle's new tokens, decided on the device (no stop strings)."""

from __future__ import annotations

import torch


def output_ends(
    tokens: torch.Tensor, generated: torch.Tensor, stop_ids: torch.Tensor, max_tokens: torch.Tensor, eos: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`StopCriteria.append` without stop strings: of each row's new tokens [R, W], how many belong to the output (up
    to and including the first stop token where the row stops at them (`eos` [R]), within its `max_tokens` [R] given
    `generated` [R] so far), and whether the output ends with them: (kept int64 [R], ends bool [R])."""
    width = tokens.shape[1]
    room = (max_tokens - generated).clamp(0, width)
    positions = torch.arange(width, device=tokens.device)
    stops = torch.isin(tokens, stop_ids) & (positions[None, :] < room[:, None]) & eos[:, None]
    first = torch.where(stops, positions[None, :], width).amin(-1)
    stopped = first < width
    kept = torch.where(stopped, first + 1, room)
    return kept, stopped | (generated + kept >= max_tokens)
