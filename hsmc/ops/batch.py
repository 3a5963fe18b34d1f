"""The one small context object a forward pass needs (nano-vllm's `Context`, made explicit).

Rows bring 1..T new tokens each, padded to a rectangle [R, T] so that a batch bucket has one
static shape. Padding tokens write their KV to a trash slot and their outputs are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ForwardBatch:
    rows: torch.Tensor  # int64 [R]: row ids in the block tables
    tokens: torch.Tensor  # int64 [R, T]
    positions: torch.Tensor  # int64 [R, T]: absolute positions; padding repeats a valid one
    valid: torch.Tensor  # bool [R, T]: real tokens (a prefix of each row)
    write_slots: torch.Tensor  # int64 [R, T]: KV slot per token, the trash slot for padding
    key_slots: torch.Tensor  # int64 [R, L]: the row's slots for positions 0..L-1
    max_context: int  # L: a host-known upper bound on every row's context after this step

    @classmethod
    def build(
        cls,
        block_table: torch.Tensor,
        rows: torch.Tensor,
        tokens: torch.Tensor,
        num_new: torch.Tensor,
        start: torch.Tensor,
        max_context: int,
        trash_slot: int,
    ) -> ForwardBatch:
        """Batch for `tokens[i, :num_new[i]]` at positions `start[i]...` of row `rows[i]`.

        The rows' block tables must already hold slots for those positions (the row owns its
        tokens; each model of a stack fills its own cache at the same slots when it gets to them).
        `max_context` bounds start + num_new for every row; the caller tracks it on the host so no
        sync is needed to size the key gather.
        """
        offsets = torch.arange(tokens.shape[1], device=tokens.device)
        valid = offsets[None, :] < num_new[:, None]
        positions = start[:, None] + torch.minimum(offsets[None, :], (num_new - 1).clamp_min(0)[:, None])
        table = block_table[rows]
        write_slots = torch.where(valid, table.gather(1, positions), trash_slot)
        return cls(
            rows=rows,
            tokens=tokens,
            positions=positions,
            valid=valid,
            write_slots=write_slots,
            key_slots=table[:, :max_context],
            max_context=max_context,
        )
