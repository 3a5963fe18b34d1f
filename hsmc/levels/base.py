"""The Level interface and the row state every model-backed level shares.

A level is a sampler with known log-probabilities. Between levels all positions are absolute
(the prompt occupies the same positions everywhere), so the conversation is three calls:

- `propose(rows, k)`: k more tokens after what the caller has acknowledged, with log q.
- `commit(rows, n)`: the caller keeps the first n proposed tokens and adds nothing.
- `accept(rows, keep_len, next_token)`: the caller keeps the row's first `keep_len` tokens and
  appends `next_token` (a correction or bonus this level may not have proposed). The level drops
  everything past `keep_len`, rolls its KV back, and tells the level below the same.

`SequenceState` implements the bookkeeping for one model: `seq[row, :seq_len]` is the level's
view (acknowledged tokens plus its own unacknowledged ones) and the block-table length is how
many of them are in its KV. A forward always processes `seq[kv_len:seq_len]`, so a token
appended from above (the "deferred bonus") is simply processed with the next step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch

from hsmc.engine.kv_pool import BlockTables, SlotAllocator
from hsmc.engine.runner import ModelRunner
from hsmc.models.decoder import DecoderLM


@dataclass
class StepOutput:
    """A forward over each row's pending tokens; row i's outputs are the first count[i] entries."""

    logits: torch.Tensor  # [R, W, V]
    count: torch.Tensor  # [R] tokens processed per row
    start: torch.Tensor  # [R] position of the first processed token
    features: torch.Tensor | None  # [R, W, n·H]: residual streams at the requested layers, concatenated

    def last(self, n: int) -> torch.Tensor:
        """The last n valid logits of each row: [R, n, V]."""
        idx = (self.count[:, None] - n + torch.arange(n, device=self.count.device)).clamp_min(0)
        return self.logits.gather(1, idx[:, :, None].expand(-1, -1, self.logits.shape[-1]))


@dataclass
class Proposal:
    tokens: torch.Tensor  # int64 [R, k]
    logq: torch.Tensor  # float [R, k]: log-prob of each token under the level's guaranteed distribution
    logprobs: torch.Tensor | None  # float [R, k, V]: that full distribution; None = deterministic (one-hot)


class Level(Protocol):
    """What a level above (or the decoding driver) may call."""

    state: SequenceState
    feature_layers: tuple[int, ...]  # residual streams this level wants from the verifier above (EAGLE3)

    def prefill(self, rows: torch.Tensor, features: StepOutput | None = None) -> None:
        """Process the prompt; `features` as in `accept` (the verifier's prompt forward)."""
        ...

    def propose(self, rows: torch.Tensor, k: int) -> Proposal: ...
    def commit(self, rows: torch.Tensor, n: int) -> None: ...
    def accept(
        self, rows: torch.Tensor, keep_len: torch.Tensor, next_token: torch.Tensor, features: StepOutput | None = None
    ) -> None:
        """`features`: the verifier's forward that decided this (its `features` at `feature_layers`);
        positions below keep_len are committed, so a feature-reading drafter may consume those."""
        ...

    def fork(self, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None: ...
    def release(self, rows: torch.Tensor) -> None: ...
    def load_prompts(self, rows: torch.Tensor, prompts: list[list[int]]) -> None: ...
    def reset_stats(self) -> None: ...
    def stats(self) -> dict[str, float]: ...


class SequenceState:
    """One model's rows: token sequences, KV through block tables, and the forward over pending tokens."""

    def __init__(self, model: DecoderLM, max_rows: int, capacity: int, device: torch.device) -> None:
        self.tables = BlockTables(SlotAllocator(capacity, device), max_rows, capacity)
        self.runner = ModelRunner(model, self.tables)
        self.model = model
        self.seq = torch.zeros(max_rows, capacity, dtype=torch.int64, device=device)
        self.seq_len = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.forward_seconds = 0.0

    @property
    def kv_len(self) -> torch.Tensor:
        return self.tables.length

    def load_prompts(self, rows: torch.Tensor, prompts: list[list[int]]) -> None:
        for row, prompt in zip(rows.tolist(), prompts):
            self.seq[row, : len(prompt)] = torch.tensor(prompt, device=self.seq.device)
            self.seq_len[row] = len(prompt)

    def append(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Append tokens [R, m] to the rows' sequences (not yet in KV)."""
        cols = self.seq_len[rows][:, None] + torch.arange(tokens.shape[1], device=tokens.device)
        self.seq[rows[:, None], cols] = tokens
        self.seq_len[rows] += tokens.shape[1]

    def truncate(self, rows: torch.Tensor, keep_len: torch.Tensor, next_token: torch.Tensor) -> None:
        """Keep seq[:keep_len], append next_token; KV past keep_len is rolled back."""
        self.seq[rows, keep_len] = next_token
        self.seq_len[rows] = keep_len + 1
        kv = self.kv_len[rows]
        drop = (kv - keep_len).clamp_min(0)
        if bool((drop > 0).any()):
            self.tables.rollback(rows, drop, int(drop.max()))

    def forward(self, rows: torch.Tensor, end: torch.Tensor | None = None, capture: tuple[int, ...] = ()) -> StepOutput:
        """Process each row's pending tokens seq[kv_len:end] (end defaults to seq_len), capturing the
        residual stream at `capture` (transformers' hidden_states numbering) when asked."""
        start_time = time.perf_counter()
        end = self.seq_len[rows] if end is None else end
        start = self.kv_len[rows].clone()
        count = end - start
        width = int(count.max())
        if width == 0:  # e.g. prefilling one-token prompts: everything stays pending
            empty = torch.empty(len(rows), 0, self.model.config.vocab_size, device=rows.device)
            return StepOutput(empty, count, start, None)
        offsets = torch.arange(width, device=rows.device)
        cols = (start[:, None] + offsets).clamp_max(self.seq.shape[1] - 1)
        tokens = torch.where(offsets[None, :] < count[:, None], self.seq[rows[:, None], cols], 0)
        self.tables.append(rows, width)
        self.tables.rollback(rows, width - count, width)
        out = self.runner.forward(rows, tokens, count, start, int(end.max()), capture)
        features = out.captured.flatten(2) if out.captured is not None else None
        step = StepOutput(self.model.logits(out.hidden), count, start, features)
        self.forward_seconds += time.perf_counter() - start_time
        return step

    def fork(self, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
        seq_len = self.seq_len[src_rows].clone()
        seq = self.seq[src_rows, : int(seq_len.max())]  # advanced indexing copies: safe for overlapping rows
        self.tables.copy_block_table(src_rows, dst_rows)
        self.seq[dst_rows, : seq.shape[1]], self.seq_len[dst_rows] = seq, seq_len

    def release(self, rows: torch.Tensor) -> None:
        self.tables.release(rows)
        self.seq_len[rows] = 0
