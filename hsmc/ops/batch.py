"""The one small context object a forward pass needs (nano-vllm's `Context`, made explicit).

Rows bring 0..T new tokens each, padded to a rectangle [R, T] so that a batch bucket has one
static shape. Padding tokens write their KV to the trash slot and their outputs are ignored.

A new token has two coordinates: its *column* in the row's block table (where its KV lives and
what causality is measured in: token t of row r sits at column `start[r] + t`) and its *RoPE
position*. They coincide for a plain sequence; tree drafting will put siblings at one position
in different columns, so the two are kept apart. `mask`, when given, replaces causality by an
explicit pattern over key columns (the EAGLE3 training-time test uses one; a draft tree will).
`prefix_run` is a hint for speed only: attention may read a run's common prefix once (SMC particles fork from one
prompt), and finds that prefix in the tables itself, so a wrong hint costs time, never correctness.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ForwardBatch:
    rows: torch.Tensor  # int64 [R]: row ids into `table`
    table: torch.Tensor  # int64 [max_rows + 1, C]: every row's column -> slot table (the engine's own tensor)
    tokens: torch.Tensor  # int64 [R, T]
    positions: torch.Tensor  # int64 [R, T]: RoPE positions
    write_slots: torch.Tensor  # int64 [R, T]: KV slot per new token; the trash slot for padding
    start: torch.Tensor  # int64 [R]: column of each row's first new token (= its KV length before the step)
    num_new: torch.Tensor  # int64 [R]: real tokens per row (a prefix of the T columns)
    max_context: int  # host-known bound on start + num_new over the rows (sizes the reference backend's gather)
    mask: torch.Tensor | None = None  # bool [R, T, max_context]: key columns each query sees; None = causal
    prefix_run: int = 1  # rows come in runs of this many that may share leading KV columns (an SMC request's particles)

    @property
    def context_lens(self) -> torch.Tensor:
        """Keys each row attends over after this step's writes."""
        return self.start + self.num_new

    @property
    def query_cols(self) -> torch.Tensor:
        """Column of every query [R, T]."""
        return padded_columns(self.start, self.num_new, self.tokens.shape[1])


def padded_columns(start: torch.Tensor, num_new: torch.Tensor, width: int) -> torch.Tensor:
    """Columns start[i] + j for j < width, padding repeating each row's last real column (start for empty rows)."""
    offsets = torch.arange(width, device=start.device)
    return start[:, None] + torch.minimum(offsets[None, :], (num_new - 1).clamp_min(0)[:, None])
