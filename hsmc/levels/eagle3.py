"""`eagle3` level: an EAGLE3 head drafting for the `rejection` level above it.

Position t of the head holds the pair (verifier feature f_t, token x_{t+1}); its output predicts
x_{t+2}. After every verify the rejection level hands over its captured features; the head
processes the newly committed pairs at once, and the output at the last one gives the first draft.
Further draft steps feed back the head's own pre-norm hidden state instead of f; those provisional
KV entries are rolled back when the verifier's real features arrive. Features of the last
`feature_window` positions are kept per row, so a level further up (SMC) may cut the row back a
little and the head re-processes the last pair with the new token.
"""

from __future__ import annotations

import time

import torch

from hsmc.eagle.head import Eagle3Head
from hsmc.engine.kv_pool import BlockTables, SlotAllocator
from hsmc.engine.sampler import sample
from hsmc.levels.base import Proposal, StepOutput
from hsmc.models.decoder import DecoderLM
from hsmc.ops.attention import TorchAttention
from hsmc.ops.batch import ForwardBatch
from hsmc.ops.kv_cache import KVCache


class SeqOnly:
    """The token view of an EAGLE3 level (its KV lives in `Eagle3Level.tables`)."""

    def __init__(self, max_rows: int, capacity: int, device: torch.device) -> None:
        self.seq = torch.zeros(max_rows, capacity, dtype=torch.int64, device=device)
        self.seq_len = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.forward_seconds = 0.0


class Eagle3Level:
    def __init__(
        self,
        head: Eagle3Head,
        verifier: DecoderLM,
        feature_layers: tuple[int, ...],
        max_rows: int,
        capacity: int,
        temperature: float,
        generator: torch.Generator,
        feature_window: int = 64,
    ) -> None:
        device = verifier.model.embed_tokens.weight.device
        cfg = head.config
        self.head, self.embed = head, verifier.model.embed_tokens
        self.feature_layers = feature_layers
        self.temperature, self.generator = temperature, generator
        self.state = SeqOnly(max_rows, capacity, device)
        self.tables = BlockTables(SlotAllocator(capacity, device), max_rows, capacity)
        self.cache = KVCache(1, capacity, cfg.num_kv_heads, cfg.head_dim, head.fc.weight.dtype, device)
        self.backend = TorchAttention()
        h, dtype = cfg.hidden_size, head.fc.weight.dtype
        self.window = feature_window
        self.features = torch.zeros(max_rows, feature_window, 3 * h, dtype=dtype, device=device)
        self.last_hidden = torch.zeros(max_rows, h, dtype=dtype, device=device)
        self.last_logits = torch.zeros(max_rows, verifier.config.vocab_size, dtype=torch.float32, device=device)
        self.final_len = torch.zeros(max_rows, dtype=torch.int64, device=device)  # feature-based pairs in KV
        self.target_ids = head.to_target_ids(torch.arange(head.draft_vocab_size, device=device))

    # -- the Level interface ---------------------------------------------------------------
    def load_prompts(self, rows: torch.Tensor, prompts: list[list[int]]) -> None:
        if any(len(p) < 2 for p in prompts):
            raise ValueError("an eagle3 drafter needs prompts of at least 2 tokens (its first pair is (f_0, x_1))")
        for row, prompt in zip(rows.tolist(), prompts):
            self.state.seq[row, : len(prompt)] = torch.tensor(prompt, device=self.state.seq.device)
            self.state.seq_len[row] = len(prompt)
        self.final_len[rows] = 0

    def prefill(self, rows: torch.Tensor, features: StepOutput | None = None) -> None:
        if features is None:
            raise ValueError("an eagle3 level must sit directly under a rejection level (it reads its features)")
        upto = self.state.seq_len[rows] - 1
        self._store(rows, features, upto)
        self._process_pairs(rows, upto, prompt_features=features.features)

    def propose(self, rows: torch.Tensor, k: int) -> Proposal:
        tokens, logq, logprobs = [], [], []
        position = self.final_len[rows].clone()  # the next provisional pair's position
        for step in range(k):
            if step:
                hidden, logits = self._forward(rows, tokens[-1][:, None], self.last_hidden[rows][:, None], position)
                self.last_hidden[rows], self.last_logits[rows] = hidden[:, 0], self._full_vocab(logits[:, 0])
                position = position + 1
            last = self.last_logits[rows]
            tok, lp = sample(last, self.temperature, self.generator)
            tokens.append(tok)
            logq.append(lp)
            if self.temperature > 0:
                logprobs.append(torch.log_softmax(last / self.temperature, -1))
        drafts = torch.stack(tokens, 1)
        cols = self.state.seq_len[rows][:, None] + torch.arange(k, device=rows.device)
        self.state.seq[rows[:, None], cols] = drafts
        self.state.seq_len[rows] += k
        return Proposal(drafts, torch.stack(logq, 1), torch.stack(logprobs, 1) if logprobs else None)

    def commit(self, rows: torch.Tensor, n: int) -> None:
        """Nothing to do: a drafter never proposes more than it was asked for."""

    def accept(
        self, rows: torch.Tensor, keep_len: torch.Tensor, next_token: torch.Tensor, features: StepOutput | None = None
    ) -> None:
        self.state.seq[rows, keep_len] = next_token
        self.state.seq_len[rows] = keep_len + 1
        if features is not None:
            self._store(rows, features, keep_len)
        # keep only feature-based pairs whose next token is still right: positions < keep_len - 1
        valid = torch.minimum(self.final_len[rows], keep_len - 1)
        drop = self.tables.length[rows] - valid
        self.tables.rollback(rows, drop, int(drop.max()))
        self.final_len[rows] = valid
        self._process_pairs(rows, keep_len)

    def fork(self, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
        width = int(self.state.seq_len[src_rows].max())
        copies = [
            (t, t[src_rows].clone())
            for t in (self.state.seq_len, self.features, self.last_hidden, self.last_logits, self.final_len)
        ]
        seq = self.state.seq[src_rows, :width]
        self.tables.copy_block_table(src_rows, dst_rows)
        self.state.seq[dst_rows, :width] = seq
        for tensor, value in copies:
            tensor[dst_rows] = value

    def release(self, rows: torch.Tensor) -> None:
        self.tables.release(rows)
        self.state.seq_len[rows] = 0
        self.final_len[rows] = 0

    def reset_stats(self) -> None:
        self.state.forward_seconds = 0.0

    def stats(self) -> dict[str, float]:
        return {"forward_seconds": self.state.forward_seconds}

    # -- internals ------------------------------------------------------------------------
    def _store(self, rows: torch.Tensor, features: StepOutput, upto: torch.Tensor) -> None:
        """Keep the verifier's features of positions < upto in the per-row ring."""
        offsets = torch.arange(features.features.shape[1], device=rows.device)
        positions = features.start[:, None] + offsets
        valid = (offsets[None, :] < features.count[:, None]) & (positions < upto[:, None])
        r, j = torch.nonzero(valid, as_tuple=True)
        self.features[rows[r], positions[r, j] % self.window] = features.features[r, j].to(self.features.dtype)

    def _process_pairs(
        self, rows: torch.Tensor, upto: torch.Tensor, prompt_features: torch.Tensor | None = None
    ) -> None:
        """Run the head over pairs (f_t, x_{t+1}) for t in [final_len, upto); keep the last output.

        Features come from the ring, or for the prompt (which may be longer than the ring) straight
        from the verifier's prefill output, whose positions start at 0 like the pairs."""
        start = self.final_len[rows]
        count = upto - start
        width = int(count.max())
        offsets = torch.arange(width, device=rows.device)
        positions = start[:, None] + offsets
        valid = offsets[None, :] < count[:, None]
        safe = torch.where(valid, positions, start[:, None])
        tokens = self.state.seq[rows[:, None], safe + 1]
        if prompt_features is not None:
            feats = prompt_features[:, :width]
        else:
            torch._assert_async((start >= upto - self.window).all(), "eagle3 feature window exceeded")
            feats = self.features[rows[:, None], safe % self.window]
        hidden = self.head.fc(feats.to(self.features.dtype))
        out, logits = self._forward(rows, tokens, hidden, start, count)
        last = (count - 1)[:, None, None]
        self.last_hidden[rows] = out.gather(1, last.expand(-1, -1, out.shape[-1]))[:, 0]
        self.last_logits[rows] = self._full_vocab(logits.gather(1, last.expand(-1, -1, logits.shape[-1]))[:, 0])
        self.final_len[rows] = upto

    def _forward(
        self,
        rows: torch.Tensor,
        tokens: torch.Tensor,
        hidden: torch.Tensor,
        start: torch.Tensor,
        count: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Head forward over pairs at positions start..; appends their KV slots."""
        began = time.perf_counter()
        width = tokens.shape[1]
        count = torch.full_like(start, width) if count is None else count
        self.tables.append(rows, width)
        self.tables.rollback(rows, width - count, width)
        batch = ForwardBatch.build(
            self.tables.table, rows, tokens, count, start, int((start + count).max()), self.cache.trash_slot
        )
        with torch.inference_mode():
            out = self.head(self.embed(tokens).to(hidden.dtype), hidden, batch, self.cache, self.backend)
        self.state.forward_seconds += time.perf_counter() - began
        return out

    def _full_vocab(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits placed in the verifier's vocabulary (-inf elsewhere)."""
        full = torch.full_like(self.last_logits[: len(draft_logits)], float("-inf"))
        full[:, self.target_ids] = draft_logits.float()
        return full
