"""The Level interface and the row state every model-backed level shares.

A level is a sampler with known log-probabilities. Between levels all positions are absolute
(the prompt occupies the same positions everywhere), so the conversation is a few calls:

- `propose(rows, k)`: k more tokens after what the caller has acknowledged, with log q. A verifier
  above asks `at_most=True`: a level may then hand fewer (at least 1) per row, without host reads.
- `commit(rows, n)`: the caller keeps the first n proposed tokens and adds nothing.
- `accept(rows, keep_len, next_token, mask=...)`: the caller keeps the row's first `keep_len` tokens and
  appends `next_token` (a correction or bonus this level may not have proposed). The level drops
  everything past `keep_len`, rolls its KV back, and tells the level below the same. Rows where `mask`
  is False are left exactly as they are (an SMC step deferred because the row's proposal was short).
- `step(rows)` (a streaming top only): one round of work for every row, handing over all the tokens
  it produced (1 for a model level, 1..γ+1 for a rejection level).

`SequenceState` implements the bookkeeping for one model: `seq[row, :seq_len]` is the level's
view (acknowledged tokens plus its own unacknowledged ones) and the block-table length is how
many of them are in its KV. A forward always processes `seq[kv_len:seq_len]`, so a token
appended from above (the "deferred bonus") is simply processed with the next step.

Nothing here reads the device: a forward's width and context come from host-side *bounds*
(`pending_bound` >= every row's unprocessed tokens, `len_bound` >= every row's length), kept
exact enough by the static shape of each operation, and tightened by the driver from its one
read per step. Rows that bring fewer tokens than the width are padded (trash writes).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from hsmc.engine.graphs import GraphParts, HostField
from hsmc.engine.host_io import upload
from hsmc.engine.runner import ModelRunner
from hsmc.engine.timer import ForwardTimer
from hsmc.levels.block_fill import BlockFill
from hsmc.levels.tree import Tree, TreeShape, tree_mask
from hsmc.ops.backend import Backend, TorchBackend, sequence_window


@dataclass
class StepOutput:
    """A forward over each row's pending tokens; row i's outputs are the first count[i] entries."""

    logits: torch.Tensor  # [R, W, V] (or [R, 1, V] for a last-only forward)
    count: torch.Tensor  # [R] tokens processed per row
    start: torch.Tensor  # [R] position of the first processed token
    features: torch.Tensor | None  # [R, W, n·H]: residual streams at the runner's capture layers, concatenated

    def take(self, index: torch.Tensor) -> StepOutput:
        """Row index[i]'s outputs as row i (e.g. a prompt's forward for each of its particles)."""
        features = None if self.features is None else self.features[index]
        return StepOutput(self.logits[index], self.count[index], self.start[index], features)

    def last(self, n: int) -> torch.Tensor:
        """The last n valid logits of each row: [R, n, V]."""
        idx = (self.count[:, None] - n + torch.arange(n, device=self.count.device)).clamp_min(0)
        return self.logits.gather(1, idx[:, :, None].expand(-1, -1, self.logits.shape[-1]))


@dataclass
class Proposal:
    tokens: torch.Tensor  # int64 [R, k]
    logq: torch.Tensor  # float [R, k]: log-prob of each token under the level's guaranteed distribution
    logprobs: torch.Tensor | None  # float [R, k, V]: that full distribution; None = deterministic (one-hot),
    # or not kept: a level asked for exactly k (by smc, which reads logq only) hands no distributions
    count: torch.Tensor | None = None  # int64 [R]: tokens[i, :count[i]] are proposals (at_most); None = all k
    ready: torch.Tensor | None = None  # bool [R]: rows whose k tokens are all there (a block fill); None = all


@dataclass
class Emission:
    """What a streaming top produced in one step, as the one record the host reads: row i's tokens
    record[i, :width] (the first record[i, width] of them), then its counters (`row_counters`). A rejection level
    packs it inside its round's graph: gathering the counters after the replay cost the host ~150 µs a step, the
    whole gap of an idle `auto` to its target alone on an H200 (docs/measurements/2026-11-29-h200-warmup-idle.txt)."""

    record: torch.Tensor  # int64 [R, width + 1 + counters]
    width: int
    choice: int | None = None  # a rejection step whose draft shape was chosen: the arm (`DraftLength`)


class Level(Protocol):
    """What a level above (or the decoding driver) may call."""

    state: SequenceState
    feature_layers: tuple[int, ...]  # residual streams this level wants from the verifier above (EAGLE3)
    step_growth: int  # most tokens a row's sequence grows by in one `step` (a streaming top)
    fill: BlockFill | None  # how a rejection level fills an SMC block (its counters ride the cycle's read)

    def prefill(self, rows: torch.Tensor, features: StepOutput | None = None) -> None:
        """Process the prompt; `features` as in `accept` (the verifier's prompt forward)."""
        ...

    def propose(self, rows: torch.Tensor, k: int, at_most: bool = False) -> Proposal: ...
    def propose_tree(self, rows: torch.Tensor, shape: TreeShape, sampled: bool) -> Tree:
        """A draft tree per row after its last token (`hsmc.levels.tree.grow`): children drawn without replacement
        with `sampled`, else the top-k. The level's KV is left as before it (the accepted path is placed in `state`
        before the `accept` that follows)."""
        ...

    def commit(self, rows: torch.Tensor, n: int) -> None: ...
    def accept(
        self,
        rows: torch.Tensor,
        keep_len: torch.Tensor,
        next_token: torch.Tensor,
        features: StepOutput | None = None,
        mask: torch.Tensor | None = None,
    ) -> None:
        """`features`: the verifier's forward that decided this (its `features` at `feature_layers`);
        positions below keep_len are committed, so a feature-reading drafter may consume those."""
        ...

    def step(self, rows: torch.Tensor) -> Emission: ...
    def fork(self, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None: ...
    def release(self, rows: torch.Tensor) -> None: ...
    def row_counters(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """Per-row counters [R, 2] of every rejection level from this one down, top first (rounds, tokens emitted
        since the row's request was admitted): a request's accepted length, read with its steps."""
        ...

    def graph_parts(self) -> GraphParts:
        """The models and host ints a captured round of a level above touches through this one."""
        ...

    def load_prompts(self, rows: torch.Tensor, prompts: list[list[int]]) -> None: ...
    def set_len_bound(self, bound: int) -> None:
        """Every row of this level (and those below) is at most `bound` tokens long now (0: no row holds
        anything, e.g. before the first prompts are admitted, so no bound left by earlier rows widens a forward)."""
        ...

    def reset_stats(self) -> None: ...
    def stats(self) -> dict[str, float]: ...


def padded_prompts(prompts: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts as one padded int64 [P, longest] tensor and their lengths, uploaded without a stall."""
    longest = max(len(p) for p in prompts)
    tokens = torch.zeros(len(prompts), longest, dtype=torch.int64)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = torch.tensor(p, dtype=torch.int64)
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.int64)
    return upload(tokens, device), upload(lengths, device)


def masked_accept(
    state: TokenRows, rows: torch.Tensor, keep_len: torch.Tensor, next_token: torch.Tensor, mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`accept`'s arguments where `mask` holds, elsewhere the accept that changes nothing: keep all of the
    row's tokens but its last and append that one again (the last token is never in a model's KV)."""
    if mask is None:
        return keep_len, next_token
    own = (state.seq_len[rows] - 1).clamp_min(0)
    return torch.where(mask, keep_len, own), torch.where(mask, next_token, state.seq[rows, own])


class TokenRows:
    """Per-row token sequences on the device with a host-side length bound (an EAGLE3 level's view)."""

    def __init__(self, max_rows: int, capacity: int, device: torch.device, backend: Backend | None = None) -> None:
        self.backend = backend or TorchBackend()  # its appends and windows run as the stack's other device steps
        self.seq = torch.zeros(max_rows + 1, capacity + 1, dtype=torch.int64, device=device)
        self.seq_len = torch.zeros(max_rows + 1, dtype=torch.int64, device=device)
        self.capacity = capacity
        self.len_bound = 0

    def load_prompts(self, rows: torch.Tensor, prompts: list[list[int]]) -> None:
        tokens, lengths = padded_prompts(prompts, rows.device)
        self.seq[rows, : tokens.shape[1]] = tokens
        self.seq_len[rows] = lengths
        self.len_bound = max(self.len_bound, tokens.shape[1])

    def append(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        """Append tokens [R, m] to the rows' sequences."""
        self.backend.append_tokens(self.seq, self.seq_len, rows, tokens)
        self.len_bound += tokens.shape[1]

    def set_token(self, rows: torch.Tensor, keep_len: torch.Tensor, next_token: torch.Tensor) -> None:
        """Keep seq[:keep_len] and append next_token (keep_len never exceeds the current length)."""
        self.seq[rows, keep_len.clamp_max(self.capacity)] = next_token
        self.seq_len[rows] = keep_len + 1
        self.len_bound += 1

    def place(self, rows: torch.Tensor, start: torch.Tensor, tokens: torch.Tensor) -> None:
        """seq[row, start + j] = tokens[i, j] without changing the length: a draft tree's accepted path, which
        the `truncate` after it keeps (up to its accepted length)."""
        columns = (start[:, None] + torch.arange(tokens.shape[1], device=tokens.device)).clamp_max(self.capacity)
        self.seq[rows[:, None], columns] = tokens
        self.len_bound += tokens.shape[1]

    def window(self, rows: torch.Tensor, start: torch.Tensor, count: torch.Tensor, width: int) -> torch.Tensor:
        """seq[row, start + j] for j < count (0 past it): [R, width]."""
        return sequence_window(self.seq, rows, start, count, width)

    def bound_lengths(self, bound: int) -> None:
        """Every row is known to be at most `bound` tokens long (the driver read it, or prompts were just loaded)."""
        self.len_bound = min(self.len_bound, bound)

    def graph_parts(self) -> GraphParts:
        return GraphParts(host=[HostField(self, "len_bound", "length")])

    def copy_rows(self, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
        """dst ← src, up to the length bound (a row's tail past its length is never read)."""
        width = min(self.len_bound + 1, self.capacity + 1)
        seq, seq_len = self.seq[src_rows, :width], self.seq_len[src_rows]  # advanced indexing copies: overlap-safe
        self.seq[dst_rows, :width], self.seq_len[dst_rows] = seq, seq_len


def _place(
    out: torch.Tensor | None, rows: int, width: int, index: torch.Tensor, offset: int, part: torch.Tensor
) -> torch.Tensor:
    """Copy part [r, w, ...] into out[index, offset : offset + w] (out [rows, width, ...], zeros at first)."""
    if out is None:
        out = part.new_zeros(rows, width, *part.shape[2:])
    out[index, offset : offset + part.shape[1]] = part
    return out


def _empty_step(rows: torch.Tensor, count: torch.Tensor, start: torch.Tensor) -> StepOutput:
    """A forward with nothing to process."""
    return StepOutput(torch.empty(len(rows), 0, 0, device=rows.device), count, start, None)


class SequenceState(TokenRows):
    """One model's rows: token sequences, KV through the runner's block tables, and the forward over
    pending tokens, timed per level."""

    def __init__(self, runner: ModelRunner, max_rows: int, capacity: int, prefill_chunk_tokens: int = 8192) -> None:
        super().__init__(max_rows, capacity, runner.device, runner.backend)
        self.runner = runner
        self.prefill_chunk_tokens = prefill_chunk_tokens  # engine.prefill_chunk_tokens
        self.timer = ForwardTimer(runner.device, runner.scope)
        self.pending_bound = 0
        self.prompt_lengths: list[int] = []  # of the prompts loaded since the last forward: it is their prefill

    @property
    def kv_len(self) -> torch.Tensor:
        return self.runner.tables.length

    def load_prompts(self, rows: torch.Tensor, prompts: list[list[int]]) -> None:
        super().load_prompts(rows, prompts)
        self.prompt_lengths = [len(p) for p in prompts]

    def bound_lengths(self, bound: int) -> None:
        super().bound_lengths(bound)
        self.pending_bound = min(self.pending_bound, bound)

    def graph_parts(self) -> GraphParts:
        return super().graph_parts() + GraphParts([self.runner.module], [HostField(self, "pending_bound")])

    @staticmethod
    @contextmanager
    def admitting(states: list[SequenceState]) -> Iterator[None]:
        """Bound the pending tokens of rows admitted inside apart from the running rows': an admission prefills
        and extends only its own rows, so the bound after it is the larger of the two bounds, not their sum. (The
        sum would widen the next step of every row and miss that step's captured graph.)"""
        running = [s.pending_bound for s in states]
        for s in states:
            s.pending_bound = 0
        try:
            yield
        finally:
            for s, bound in zip(states, running):
                s.pending_bound = max(bound, s.pending_bound)

    def append(self, rows: torch.Tensor, tokens: torch.Tensor) -> None:
        super().append(rows, tokens)
        self.pending_bound += tokens.shape[1]

    def truncate(self, rows: torch.Tensor, keep_len: torch.Tensor, next_token: torch.Tensor, max_drop: int) -> None:
        """Keep seq[:keep_len], append next_token; KV past keep_len (at most `max_drop` tokens) is rolled back."""
        self.set_token(rows, keep_len, next_token)
        self.runner.tables.truncate(rows, keep_len, max_drop)
        self.pending_bound = max(1, self.pending_bound + 1)

    def forward(self, rows: torch.Tensor, leave_last: bool = False, last_only: bool = False) -> StepOutput:
        """Process each row's pending tokens (all but the last with `leave_last`); logits at every processed
        position, or only at each row's last with `last_only`.

        The forward after `load_prompts` is the prefill of those rows alone (the rows loaded, in that order):
        rows decoding beside them (continuous batching) keep their pending tokens and bound. It runs as
        forwards of at most `prefill_chunk_tokens` tokens (`_prefill_chunks`), so its activations stay that
        small however long the prompts are. Any other forward covers every row that has pending tokens, in
        one forward."""
        leave = 1 if leave_last else 0
        if self.prompt_lengths:
            if len(self.prompt_lengths) != len(rows):
                raise ValueError(f"a prefill of {len(rows)} rows after loading {len(self.prompt_lengths)} prompts")
            start, count, _ = self.pending(rows, leave, 0)
            counts, self.prompt_lengths = [max(n - leave, 0) for n in self.prompt_lengths], []
            self.pending_bound = max(self.pending_bound, leave)
            return self._prefill_chunks(rows, start, count, counts, last_only)
        width, self.pending_bound = self.pending_bound - leave, leave
        start, count, tokens = self.pending(rows, leave, max(width, 0))
        if width <= 0:
            return _empty_step(rows, count, start)
        logits, features = self._run(rows, tokens, count, last_only)
        return StepOutput(logits, count, start, features)

    def place(self, rows: torch.Tensor, start: torch.Tensor, tokens: torch.Tensor, processed: bool = False) -> None:
        """`processed`: the tokens are in the KV already (a verifier's accepted path); else they wait for a forward."""
        super().place(rows, start, tokens)
        if not processed:
            self.pending_bound += tokens.shape[1]

    def forward_tree(
        self, rows: torch.Tensor, tokens: torch.Tensor, depth: torch.Tensor, seen: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [R, N, V] (and captured features) of tree nodes tokens [R, N] appended to the KV (the rows'
        pending tokens first, then each row's last one as node 0, the root): node n sits at RoPE position root +
        depth[n] and sees the prefix and its ancestors (`seen` [R, N, N])."""
        self.forward(rows, leave_last=True)  # tokens before the root, if any wait
        n = tokens.shape[1]
        with self.timer():
            batch = self.runner.new_tokens(rows, tokens, torch.full_like(rows, n), self.len_bound + n)
            mask = tree_mask(seen, batch.start, batch.max_context)
            batch = replace(batch, positions=batch.start[:, None] + depth, mask=mask)
            out = self.runner.forward(batch)
        self.pending_bound = 0
        return out

    def pending(self, rows: torch.Tensor, leave: int, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each row's KV length, how many of its tokens past it wait for a forward (all but the last `leave`),
        and those tokens padded to `width`: (start, count, tokens [R, width])."""
        return self.backend.pending_tokens(self.seq, self.seq_len, self.kv_len, rows, leave, width)

    def _run(
        self, rows: torch.Tensor, tokens: torch.Tensor, count: torch.Tensor, last_only: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward over each row's first count[i] of tokens [R, W], appended to its KV: (logits, features)."""
        with self.timer():
            batch = self.runner.new_tokens(rows, tokens, count, self.len_bound)
            return self.runner.forward(batch, last_only)

    def _prefill_chunks(
        self, rows: torch.Tensor, start: torch.Tensor, count: torch.Tensor, counts: list[int], last_only: bool
    ) -> StepOutput:
        """The prefill as forwards of at most `prefill_chunk_tokens` tokens. Each takes only the rows with prompt
        tokens left (`counts`: their number, known on the host) and as many columns as the budget gives them, so
        prompts of different lengths are not all padded to the longest. Outputs are copied out of each forward
        (a replayed graph reuses its buffers)."""
        width = max(counts, default=0)
        if width <= 0:  # e.g. one-token prompts with `leave_last`: everything stays pending
            return _empty_step(rows, count, start)
        logits = features = None
        offset = 0
        while offset < width:
            active = [i for i, n in enumerate(counts) if n > offset]
            w = min(max(1, self.prefill_chunk_tokens // len(active)), width - offset)
            if len(active) == len(rows) and w == width:  # the whole prefill in one forward
                logits, features = self._run(rows, self.window(rows, start, count, width), count, last_only)
                return StepOutput(logits, count, start, features)
            index = upload(torch.tensor(active), rows.device)
            part_count = (count[index] - offset).clamp(0, w)
            part_tokens = self.window(rows[index], start[index] + offset, part_count, w)
            part_logits, part_features = self._run(rows[index], part_tokens, part_count, last_only)
            if last_only:  # an active row's logits are overwritten until its last chunk
                logits = _place(logits, len(rows), 1, index, 0, part_logits)
            else:
                logits = _place(logits, len(rows), width, index, offset, part_logits)
            if part_features is not None:
                features = _place(features, len(rows), width, index, offset, part_features)
            offset += w
        return StepOutput(logits, count, start, features)

    def fork(self, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
        self.copy_rows(src_rows, dst_rows)
        self.runner.tables.copy_block_table(src_rows, dst_rows, self.len_bound)

    def release(self, rows: torch.Tensor) -> None:
        self.runner.tables.release(rows, self.len_bound)
        self.seq_len.index_fill_(0, rows, 0)
