"""`eagle3` level: an EAGLE3 head drafting for the `rejection` level above it.

Position t of the head holds the pair (verifier feature f_t, token x_{t+1}); its output predicts
x_{t+2}. After every verify the rejection level hands over its captured features; the head
processes the newly committed pairs at once, and the output at the last one gives the first draft.
Further draft steps feed back the head's own pre-norm hidden state instead of f; those provisional
KV entries are rolled back when the verifier's real features arrive. Features of the last
`feature_window` positions are kept per row, so a level further up (SMC) may cut the row back a
little and the head re-processes the last pair with the new token. The head runs through the same
`ModelRunner` as every model (its own block tables, KV cache and graphs).
"""

from __future__ import annotations

import torch
from torch import nn

from hsmc.engine.runner import ModelRunner
from hsmc.engine.sampler import sample
from hsmc.engine.timer import ForwardTimer
from hsmc.levels.base import Proposal, StepOutput, TokenRows


class Eagle3Level:
    step_growth = 1  # never a top

    def __init__(
        self,
        runner: ModelRunner,
        embed: nn.Embedding,
        feature_layers: tuple[int, ...],
        max_rows: int,
        capacity: int,
        max_new_pairs: int,
        temperature: float,
        generator: torch.Generator,
        feature_window: int = 64,
    ) -> None:
        """`max_new_pairs`: most pairs one accept commits (γ + 1 under a rejection level with γ drafts)."""
        self.runner, self.head, self.embed = runner, runner.module, embed
        device = runner.device
        cfg = self.head.config
        self.feature_layers = feature_layers
        self.max_new_pairs = max_new_pairs
        self.temperature, self.generator = temperature, generator
        self.state = TokenRows(max_rows, capacity, device)
        self.timer = ForwardTimer(device)
        h, dtype = cfg.hidden_size, self.head.fc.weight.dtype
        self.window = feature_window
        self.features = torch.zeros(max_rows, feature_window + 1, 3 * h, dtype=dtype, device=device)  # + trash
        self.last_hidden = torch.zeros(max_rows, h, dtype=dtype, device=device)
        self.last_logits = torch.zeros(max_rows, cfg.vocab_size, dtype=torch.float32, device=device)
        self.final_len = torch.zeros(max_rows, dtype=torch.int64, device=device)  # feature-based pairs in KV
        self.target_ids = self.head.to_target_ids(torch.arange(self.head.draft_vocab_size, device=device))
        self.proposed = 0

    # -- the Level interface ---------------------------------------------------------------
    def load_prompts(self, rows: torch.Tensor, prompts: list[list[int]]) -> None:
        if any(len(p) < 2 for p in prompts):
            raise ValueError("an eagle3 drafter needs prompts of at least 2 tokens (its first pair is (f_0, x_1))")
        self.state.load_prompts(rows, prompts)
        self.final_len.index_fill_(0, rows, 0)

    def prefill(self, rows: torch.Tensor, features: StepOutput | None = None) -> None:
        if features is None:
            raise ValueError("an eagle3 level must sit directly under a rejection level (it reads its features)")
        upto = self.state.seq_len[rows] - 1
        self._store(rows, features, upto)
        self._process_pairs(rows, upto, features.features.shape[1], prompt_features=features.features)

    def propose(self, rows: torch.Tensor, k: int, at_most: bool = False) -> Proposal:
        tokens, logq, logprobs = [], [], []
        for step in range(k):
            if step:
                hidden, logits = self._forward(rows, tokens[-1][:, None], self.last_hidden[rows][:, None])
                self.last_hidden[rows], self.last_logits[rows] = hidden[:, 0], self._full_vocab(logits[:, 0])
            last = self.last_logits[rows]
            tok, lp = sample(last, self.temperature, self.generator)
            tokens.append(tok)
            logq.append(lp)
            if self.temperature > 0:
                logprobs.append(torch.log_softmax(last / self.temperature, -1))
        drafts = torch.stack(tokens, 1)
        self.state.append(rows, drafts)
        self.proposed = k
        return Proposal(drafts, torch.stack(logq, 1), torch.stack(logprobs, 1) if logprobs else None)

    def commit(self, rows: torch.Tensor, n: int) -> None:
        """Nothing to do: a drafter never proposes more than it was asked for."""

    def accept(
        self, rows: torch.Tensor, keep_len: torch.Tensor, next_token: torch.Tensor, features: StepOutput | None = None
    ) -> None:
        self.state.set_token(rows, keep_len, next_token)
        if features is not None:
            self._store(rows, features, keep_len)
        # keep only feature-based pairs whose next token is still right: positions < keep_len - 1
        valid = torch.minimum(self.final_len[rows], keep_len - 1)
        self.runner.tables.truncate(rows, valid, max_drop=self.proposed + self.max_new_pairs)
        self.final_len[rows] = valid
        self._process_pairs(rows, keep_len, self.max_new_pairs)

    def fork(self, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
        copies = [(t, t[src_rows]) for t in (self.features, self.last_hidden, self.last_logits, self.final_len)]
        self.state.copy_rows(src_rows, dst_rows)
        self.runner.tables.copy_block_table(src_rows, dst_rows, self.state.len_bound)
        for tensor, value in copies:
            tensor[dst_rows] = value

    def release(self, rows: torch.Tensor) -> None:
        self.runner.tables.release(rows, self.state.len_bound)
        self.state.seq_len.index_fill_(0, rows, 0)
        self.final_len.index_fill_(0, rows, 0)

    def set_len_bound(self, bound: int) -> None:
        self.state.bound_lengths(bound)

    def reset_stats(self) -> None:
        self.timer.reset()

    def stats(self) -> dict[str, float]:
        return {"forward_seconds": self.timer.seconds()}

    # -- internals ------------------------------------------------------------------------
    def _store(self, rows: torch.Tensor, features: StepOutput, upto: torch.Tensor) -> None:
        """Keep the verifier's features of positions in [upto - window, upto) in the per-row ring."""
        offsets = torch.arange(features.features.shape[1], device=rows.device)
        positions = features.start[:, None] + offsets
        valid = (offsets[None, :] < features.count[:, None]) & (positions < upto[:, None])
        valid &= positions >= (upto - self.window)[:, None]
        cols = torch.where(valid, positions % self.window, self.window)
        self.features[rows[:, None], cols] = features.features.to(self.features.dtype)

    def _process_pairs(
        self, rows: torch.Tensor, upto: torch.Tensor, width: int, prompt_features: torch.Tensor | None = None
    ) -> None:
        """Run the head over pairs (f_t, x_{t+1}) for t in [final_len, upto) (at most `width` of them); keep
        the output at the last one. Features come from the ring, or for the prompt (which may be longer
        than the ring) straight from the verifier's prefill output, whose positions start at 0 like the pairs."""
        if width <= 0:
            return
        start = self.final_len[rows]
        count = (upto - start).clamp_min(0)
        offsets = torch.arange(width, device=rows.device)
        safe = torch.where(offsets[None, :] < count[:, None], start[:, None] + offsets, start[:, None])
        tokens = self.state.window(rows, start + 1, count, width)
        if prompt_features is not None:
            feats = prompt_features[:, :width]
        else:
            torch._assert_async((start >= upto - self.window).all(), "eagle3 feature window exceeded")
            feats = self.features[rows[:, None], safe % self.window]
        out, logits = self._forward(rows, tokens, self.head.fc(feats.to(self.features.dtype)), count)
        self.last_hidden[rows] = out[:, 0]
        self.last_logits[rows] = self._full_vocab(logits[:, 0])
        self.final_len[rows] = upto

    def _forward(
        self, rows: torch.Tensor, tokens: torch.Tensor, hidden: torch.Tensor, count: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Head forward over pairs at the end of each row's head KV; outputs at each row's last pair."""
        count = torch.full_like(rows, tokens.shape[1]) if count is None else count
        with self.timer():
            batch = self.runner.new_tokens(rows, tokens, count, self.state.len_bound)
            embeds = self.embed(tokens).to(hidden.dtype)
            return self.runner.forward(batch, last_only=True, embeds=embeds, hidden=hidden)

    def _full_vocab(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits placed in the verifier's vocabulary (-inf elsewhere)."""
        full = torch.full_like(self.last_logits[: len(draft_logits)], float("-inf"))
        full[:, self.target_ids] = draft_logits.float()
        return full
