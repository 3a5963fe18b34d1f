"""`eagle3` level: an EAGLE3 head drafting for the `rejection` level above it.

Position t of the head holds the pair (verifier feature f_t, token x_{t+1}); its output predicts
x_{t+2}. After every verify the rejection level hands over its captured features; the head
processes the newly committed pairs at once, and the output at the last one gives the first draft.
Further draft steps feed back the head's own pre-norm hidden state instead of f; those provisional
KV entries are rolled back when the verifier's real features arrive. Features of the last
`feature_window` positions are kept per row, so a level further up (SMC, a rejection level above
the verifier) may cut the row back a little and the head re-processes the last pair with the new
token. Such a cut may also end on a token the verifier has not processed yet (its own last emitted
one): the pair holding it is then bridged provisionally, fed the head's own output like a draft
step, until the verifier's features for it arrive. A one-token prompt has no pair at all: the
head drafts uniformly over its vocabulary until the first verify (drafts are only proposals, so
any q that is reported truthfully keeps the verifier lossless). The head runs through the same
`ModelRunner` as every model (its own block tables, KV cache and graphs).
After a round it did not draft for (a verify of γ = 0, chosen by `num_draft_tokens: auto`) the head only stores
the features: it processes those pairs at its next draft (`pending_bound` of them at most, a count the rejection
level keeps under `max_pending`, so the features stay in the window), as a `model` drafter processes the tokens of
the rounds it sat out. Processing them every round cost such a round 7.6 % on a 2-core CPU.
"""

from __future__ import annotations

import torch
from torch import nn

from hsmc.engine.graphs import GraphParts, HostField
from hsmc.engine.random_streams import DRAW, RowStreams, purpose_of
from hsmc.engine.runner import ModelRunner
from hsmc.engine.sampler import RowLaws
from hsmc.engine.timer import ForwardTimer
from hsmc.levels.base import Proposal, StepOutput, TokenRows, masked_accept
from hsmc.levels.tree import Tree, TreeShape, frontier_batch, grow, keyed_children, top_children, tree_law


class Eagle3Level:
    step_growth = 1  # never a top
    fill = None  # drafts exactly what it is asked for: no block fill

    def __init__(
        self,
        runner: ModelRunner,
        embed: nn.Embedding,
        feature_layers: tuple[int, ...],
        max_rows: int,
        capacity: int,
        max_new_pairs: int,
        max_bridged: int,
        laws: RowLaws,
        streams: RowStreams,
        salt: int,
        feature_window: int = 64,
        prefill_chunk_tokens: int = 8192,
    ) -> None:
        """`max_new_pairs`: most pairs one verify commits (γ + 1 under a rejection level with γ drafts).
        `max_bridged`: most pairs that may lack the verifier's feature after an accept from further up: one
        per level above the verifier (each appends a token its verifier has not processed yet). `laws`, `streams`,
        `salt`: how it samples its drafts (see `ModelLevel`)."""
        self.runner, self.head, self.embed = runner, runner.module, embed
        device = runner.device
        cfg = self.head.config
        self.feature_layers = feature_layers
        self.max_new_pairs = max_new_pairs
        self.max_bridged = max_bridged
        self.laws, self.streams, self.draw = laws, streams, purpose_of(salt, DRAW)
        self.state = TokenRows(max_rows, capacity, device, runner.backend)
        self.timer = ForwardTimer(device, runner.scope)
        h, dtype = cfg.hidden_size, self.head.fc.weight.dtype
        self.window = feature_window
        self.prefill_chunk_tokens = prefill_chunk_tokens  # engine.prefill_chunk_tokens
        self.features = torch.zeros(max_rows, feature_window + 1, 3 * h, dtype=dtype, device=device)  # + trash
        self.feature_len = torch.zeros(max_rows, dtype=torch.int64, device=device)  # features known below it
        # head output at the last feature-based pair, and at the end of the head's KV (where drafting goes on)
        self.final_hidden = torch.zeros(max_rows, h, dtype=dtype, device=device)
        self.final_logits = torch.zeros(max_rows, cfg.vocab_size, dtype=torch.float32, device=device)
        self.last_hidden = torch.zeros(max_rows, h, dtype=dtype, device=device)
        self.last_logits = torch.zeros(max_rows, cfg.vocab_size, dtype=torch.float32, device=device)
        self.final_len = torch.zeros(max_rows, dtype=torch.int64, device=device)  # feature-based pairs in KV
        self.target_ids = self.head.to_target_ids(torch.arange(self.head.draft_vocab_size, device=device))
        self.no_pair_logits = self._full_vocab(torch.zeros(1, self.head.draft_vocab_size, device=device))[0]
        self.proposed = 0  # head KV entries of the drafts since the last accept (0: this round drafted nothing)
        self.pending_bound = 0  # >= every row's pairs left unprocessed by rounds it did not draft for
        # most such pairs: their features must stay in the window beside a round's new and bridged pairs. Only a top
        # rejection level (`auto`) leaves pairs waiting, so no level above cuts the row back into the window; at
        # the limit a round is forced to draft (2.2 ms against 0.6 on an H200 with SmolLM2), so the limit is wide.
        self.max_pending = feature_window - max_new_pairs - max_bridged

    # -- the Level interface ---------------------------------------------------------------
    def load_prompts(self, rows: torch.Tensor, prompts: list[list[int]]) -> None:
        self.state.load_prompts(rows, prompts)
        for length in (self.final_len, self.feature_len):
            length.index_fill_(0, rows, 0)
        self.final_hidden.index_fill_(0, rows, 0.0)
        self.final_logits[rows] = self.no_pair_logits

    def prefill(self, rows: torch.Tensor, features: StepOutput | None = None) -> None:
        """Process the prompt's pairs from the verifier's prompt forward (which leaves the last token pending;
        a one-token prompt brings no feature and no pair)."""
        if features is None:
            raise ValueError("an eagle3 level must sit directly under a rejection level (it reads its features)")
        upto = self.state.seq_len[rows] - 1
        if features.features is not None:
            self._store(rows, features, upto)
            width = features.features.shape[1]
            chunk = max(1, self.prefill_chunk_tokens // len(rows))  # like the verifier's prefill
            for offset in range(0, width, chunk):
                w = min(chunk, width - offset)
                part = features.features[:, offset : offset + w]
                self._process_pairs(rows, upto.clamp_max(offset + w), w, prompt_features=part)
        self.last_hidden[rows], self.last_logits[rows] = self.final_hidden[rows], self.final_logits[rows]

    def propose(self, rows: torch.Tensor, k: int, at_most: bool = False) -> Proposal:
        self._catch_up(rows)
        law = self.laws.at(rows)
        start = self.state.seq_len[rows]  # the first draft's position
        tokens, logq, logprobs = [], [], []
        for step in range(k):
            if step:
                hidden, logits = self._forward(rows, tokens[-1][:, None], self.last_hidden[rows][:, None])
                self.last_hidden[rows], self.last_logits[rows] = hidden[:, 0], self._full_vocab(logits[:, 0])
            last = self.last_logits[rows]
            tok, lp = law.sample(last, self.streams.keys(rows, self.draw, start + step))
            tokens.append(tok)
            logq.append(lp)
            if not law.greedy and at_most:  # a verifier above needs q(·); smc reads logq alone
                logprobs.append(law.log_probs(last))
        drafts = torch.stack(tokens, 1)
        self.state.append(rows, drafts)
        self.proposed = k
        return Proposal(drafts, torch.stack(logq, 1), torch.stack(logprobs, 1) if logprobs else None)

    def propose_tree(self, rows: torch.Tensor, shape: TreeShape, sampled: bool) -> Tree:
        """EAGLE-2's dynamic tree: the root's law is the head's output at the last pair; each depth's frontier
        runs as one head forward (`frontier_batch`), every node fed its parent's pre-norm output as a chain's draft
        step is. The provisional KV entries are rolled back by the next `accept`, as a chain's are."""
        self._catch_up(rows)
        law = self.laws.at(rows)
        start = self.state.seq_len[rows]  # the first draft's position
        outputs = self.last_hidden[rows][:, None]  # [R, nodes so far, H]: each node's pre-norm output
        run = torch.zeros(len(rows), 0, dtype=torch.int64, device=rows.device)  # nodes in the head's KV

        def expand(tree: Tree, frontier: torch.Tensor) -> torch.Tensor:
            nonlocal run, outputs
            parents = tree.parent.gather(1, frontier)
            hidden = outputs.gather(1, parents[:, :, None].expand(-1, -1, outputs.shape[-1]))
            batch = frontier_batch(self.runner, rows, tree, frontier, run, self.state.len_bound)
            with self.timer():
                out, logits = self.runner.forward(
                    batch, embeds=self.embed(batch.tokens).to(hidden.dtype), hidden=hidden
                )
            outputs = torch.cat(
                [outputs, outputs.new_zeros(len(rows), tree.size - outputs.shape[1], outputs.shape[-1])], 1
            )
            outputs = outputs.scatter(1, frontier[:, :, None].expand_as(out), out)
            run = torch.cat([run, frontier], 1)
            return tree_law(law, self._full_vocab(logits))

        root_logq = tree_law(law, self.last_logits[rows])
        children = keyed_children(law.backend, self.streams, rows, self.draw, start) if sampled else top_children
        root = self.state.seq[rows, start - 1]
        tree = grow(root, root_logq, expand, shape.depth, shape.topk, shape.budget, children)
        self.proposed = max(1, (shape.depth - 1) * shape.topk)  # head KV entries past the pairs (a bound), rolled
        # back by accept; never 0, which would read as a round it did not draft for
        return tree

    def commit(self, rows: torch.Tensor, n: int) -> None:
        """Nothing to do: a drafter never proposes more than it was asked for."""

    def accept(
        self,
        rows: torch.Tensor,
        keep_len: torch.Tensor,
        next_token: torch.Tensor,
        features: StepOutput | None = None,
        mask: torch.Tensor | None = None,
    ) -> None:
        """A masked-out row re-processes its last pair (same result): an accept that changes nothing."""
        keep_len, next_token = masked_accept(self.state, rows, keep_len, next_token, mask)
        self.state.set_token(rows, keep_len, next_token)
        self.feature_len[rows] = torch.minimum(self.feature_len[rows], keep_len)
        if features is not None:
            self._store(rows, features, keep_len)
        # keep only feature-based pairs whose next token is still right: positions < keep_len - 1
        valid = torch.minimum(self.final_len[rows], keep_len - 1)
        provisional = self.proposed + self.max_bridged  # draft steps and bridged pairs past final_len
        self.runner.tables.truncate(rows, valid, max_drop=provisional + self.max_new_pairs)
        self.final_len[rows] = valid
        drafted, self.proposed = self.proposed, 0
        if features is not None:  # from the verifier: every pair up to keep_len has its feature now
            if not drafted:  # a round of γ = 0: processed at the next draft
                self.pending_bound += 1
                return
            self._process_pairs(rows, keep_len, self.max_new_pairs + self.max_bridged + self.pending_bound)
            self.pending_bound = 0
            return
        known = torch.minimum(self.feature_len[rows], keep_len)  # pairs t < known have their feature
        torch._assert_async(
            (known >= keep_len - self.max_bridged).all(), "eagle3: more pairs lack features than levels"
        )
        self._process_pairs(rows, known, 1 + self.pending_bound)
        self.pending_bound = 0
        self._bridge(rows, known, keep_len)

    def fork(self, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
        per_row = (self.features, self.feature_len, self.final_hidden, self.final_logits, self.final_len)
        copies = [(t, t[src_rows]) for t in (*per_row, self.last_hidden, self.last_logits)]
        self.state.copy_rows(src_rows, dst_rows)
        self.runner.tables.copy_block_table(src_rows, dst_rows, self.state.len_bound)
        for tensor, value in copies:
            tensor[dst_rows] = value

    def release(self, rows: torch.Tensor) -> None:
        self.runner.tables.release(rows, self.state.len_bound)
        for length in (self.state.seq_len, self.final_len, self.feature_len):
            length.index_fill_(0, rows, 0)

    def row_counters(self, rows: torch.Tensor) -> list[torch.Tensor]:
        return []

    def set_len_bound(self, bound: int) -> None:
        """Also bounds the backlog: a row holds no more waiting pairs than tokens, so the bound of 0 the driver sets
        when no row is left ends it with its requests (the next requests must not meet a forced drafting round)."""
        self.state.bound_lengths(bound)
        self.pending_bound = min(self.pending_bound, bound)

    def graph_parts(self) -> GraphParts:
        own = GraphParts([self.head], [HostField(self, "proposed"), HostField(self, "pending_bound")])
        return self.state.graph_parts() + self.laws.graph_parts() + own

    def reset_stats(self) -> None:
        self.timer.reset()

    def stats(self) -> dict[str, float]:
        return {"forward_seconds": self.timer.seconds(), "forwards": self.timer.count}

    # -- internals ------------------------------------------------------------------------
    def _catch_up(self, rows: torch.Tensor) -> None:
        """Before a draft: process the pairs that rounds of γ = 0 left (rows without any keep their last output,
        which may be a bridged pair's)."""
        if not self.pending_bound:
            return
        upto = torch.maximum(torch.minimum(self.feature_len[rows], self.state.seq_len[rows] - 1), self.final_len[rows])
        behind = (upto > self.final_len[rows])[:, None]
        hidden, logits = self.last_hidden[rows], self.last_logits[rows]
        self._process_pairs(rows, upto, self.pending_bound)
        self.last_hidden[rows] = torch.where(behind, self.last_hidden[rows], hidden)
        self.last_logits[rows] = torch.where(behind, self.last_logits[rows], logits)
        self.pending_bound = 0

    def _store(self, rows: torch.Tensor, features: StepOutput, upto: torch.Tensor) -> None:
        """Keep the verifier's features of positions in [upto - window, upto) in the per-row ring."""
        offsets = torch.arange(features.features.shape[1], device=rows.device)
        positions = features.start[:, None] + offsets
        valid = (offsets[None, :] < features.count[:, None]) & (positions < upto[:, None])
        valid &= positions >= (upto - self.window)[:, None]
        cols = torch.where(valid, positions % self.window, self.window)
        self.features[rows[:, None], cols] = features.features.to(self.features.dtype)
        stored_end = torch.minimum(features.start + features.count, upto)  # the verifier runs on from feature_len
        self.feature_len[rows] = torch.maximum(self.feature_len[rows], stored_end)

    def _process_pairs(
        self, rows: torch.Tensor, upto: torch.Tensor, width: int, prompt_features: torch.Tensor | None = None
    ) -> None:
        """Run the head over pairs (f_t, x_{t+1}) for t in [final_len, upto) (at most `width` of them); the
        output at the last one becomes the final and the last output (rows with no new pair keep their final
        one). Features come from the ring, or for the prompt (which may be longer than the ring) straight
        from the verifier's prefill output (a chunk of it, from the first pair not processed yet)."""
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
        new = (count > 0)[:, None]
        self.final_hidden[rows] = torch.where(new, out[:, 0], self.final_hidden[rows])
        self.final_logits[rows] = torch.where(new, self._full_vocab(logits[:, 0]), self.final_logits[rows])
        self.last_hidden[rows], self.last_logits[rows] = self.final_hidden[rows], self.final_logits[rows]
        self.final_len[rows] = upto

    def _bridge(self, rows: torch.Tensor, known: torch.Tensor, keep_len: torch.Tensor) -> None:
        """Pairs t in [known, keep_len) lack the verifier's f_t: provisional pairs fed the head's own output at
        t - 1 instead (like draft steps), so drafting starts after the newest token; rolled back at the next
        accept, which re-processes them once their features have arrived."""
        hidden = self.final_hidden[rows]
        for j in range(self.max_bridged):
            missing = known + j < keep_len
            token = self.state.seq[rows, (known + j + 1).clamp_max(self.state.capacity)]
            out, logits = self._forward(rows, token[:, None], hidden[:, None], missing.to(torch.int64))
            hidden = torch.where(missing[:, None], out[:, 0], hidden)
            self.last_hidden[rows] = hidden
            self.last_logits[rows] = torch.where(
                missing[:, None], self._full_vocab(logits[:, 0]), self.last_logits[rows]
            )

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
        vocab = self.last_logits.shape[-1]
        full = draft_logits.new_full((*draft_logits.shape[:-1], vocab), float("-inf"), dtype=torch.float32)
        full[..., self.target_ids] = draft_logits.float()
        return full
