"""`rejection` level: lossless speculative sampling over the level below (DESIGN.md §2).

One cycle per row: the drafter proposes γ tokens with distributions q_i; ONE verifier forward over
[pending, d_1..d_γ] gives p_1..p_{γ+1} at temperature T. Draft i is kept with probability
min(1, p_i(d_i)/q_i(d_i)) (q one-hot for deterministic drafts); at the first rejection the
correction is drawn from norm(max(0, p_i − q_i)); if all are kept a bonus comes from p_{γ+1}.
At T = 0 drafts are kept while they equal argmax p_i, and the argmax follows. Rows advance by
different amounts; rejected positions are rolled back in both models' KV.

With `tree` the drafter grows a draft tree instead (`hsmc.levels.tree`) and ONE verifier forward runs its
nodes under a tree mask; the walk of `tree_rule` (`hsmc.speculative.tree_verify`) keeps a path and draws the token
after it, and the path's KV is moved to the front of the tree's block before the usual rollback (docs/design.md,
"Tree drafting"). A round then emits 1..depth+1 tokens, as a chain of γ = depth does.

Tokens emitted beyond what the level above asked for are buffered in `seq` (surplus). The
log-probability handed upward is the verifier's own log_softmax(ℓ/T) at each emitted token.

A rejection level may draft for another one (TriForce-style `[model, rejection, rejection]`). The
verifier above asks `at_most` γ_above tokens: this level runs ceil(γ_above / (γ+1)) cycles for all
rows, with no host read, and hands over what they emitted (1..γ_above per row) together with its
model's full distribution log_softmax(ℓ/T) at each of those positions, which the residual
max(0, p − q) above needs. At T = 0 its output is its model's greedy decode: q is one-hot.

Under an `smc` level, asked for exactly K tokens, it fills the block with a host-chosen number of rounds
(`BlockFill`): rows already holding K idle through a mask, and rows still short are reported in
`Proposal.ready`, so the SMC level defers their group's step instead of reading the device.

With `num_draft_tokens: auto` or `tree: auto` (a streaming top) each step's draft shape (a chain's γ, or a tree)
is chosen by `DraftLength` from the rounds read so far; γ = 0 is a round of the verifier alone (the drafter
catches up on the tokens at its next draft).

With `graph_rounds` (CUDA) a round — the drafter's proposals (a chain or a tree), the verify, the acceptance test
and both models' rollback — is a graphed unit (`Graphs`: one CUDA graph per shape, replayed), timed as a whole.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from hsmc.engine.graphs import GraphParts, Graphs, HostField
from hsmc.engine.host_io import read_counters
from hsmc.engine.random_streams import ACCEPT, RESIDUAL, RowStreams, purpose_of
from hsmc.engine.sampler import RowLaws
from hsmc.levels.base import Emission, Level, Proposal, SequenceState, StepOutput, masked_accept
from hsmc.levels.block_fill import BlockFill
from hsmc.levels.draft_length import DraftLength
from hsmc.levels.tree import TreeShape, ancestors, path
from hsmc.models.size import weight_bytes
from hsmc.ops.counter_hash import combine, uniform
from hsmc.speculative.tree_verify import DRAWN_RULES


class RejectionLevel:
    feature_layers: tuple[int, ...] = ()  # a rejection level drafting for another reads no verifier features

    def __init__(
        self,
        state: SequenceState,
        drafter: Level,
        num_draft_tokens: int,
        laws: RowLaws,
        streams: RowStreams,
        salt: int,
        graph_rounds: bool = False,
        tree: TreeShape | None = None,
        tree_rule: str = "target_only",
        draft_length: DraftLength | None = None,
    ) -> None:
        """`laws`: the law each row's tokens must follow exactly; `streams`, `salt`: its random streams and its
        depth under the top. `graph_rounds`: capture each round as one CUDA graph (the runner must have CUDA
        graphs; not for a level drafting for another rejection level, whose rounds run inside that level's).
        `tree`: draft trees of this shape instead of chains of `num_draft_tokens` (then its depth), verified by
        `tree_rule` (`hsmc.speculative.tree_verify`). `draft_length`: choose each step's draft shape among its arms
        (chains of up to `num_draft_tokens`, and its trees)."""
        self.state = state
        self.drafter = drafter
        self.tree_rule = tree_rule
        self.draft_length = draft_length
        self._take(num_draft_tokens, tree)  # the next round's shape (with `draft_length`, chosen per step)
        longest = self.gamma  # the longest path of drafts a round may keep
        if draft_length is not None:
            longest = max(draft_length.shape(arm)[0] for arm in range(draft_length.arms))
        self.drafted = self.steps = 0  # drafts per row and steps, summed over steps (a chosen γ's mean)
        self.idle_drafter = False  # the step's round leaves the drafter out (`auto` gone idle: `DraftLength`)
        self.step_growth = longest + 1
        self.laws = laws
        self.streams = streams
        self.accept_purpose, self.residual_purpose = purpose_of(salt, ACCEPT), purpose_of(salt, RESIDUAL)
        max_rows, width = state.seq.shape
        device = state.seq.device
        self.seq_logq = torch.zeros(max_rows, width, dtype=torch.float32, device=device)
        self.acknowledged = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self.ahead = 0  # most tokens a row holds past what the caller acknowledged (bounds accept's rollback)
        # row-rounds by tokens emitted (entry i: i + 1), on the device: read by stats() and the block fill
        self.yields = torch.zeros(longest + 1, dtype=torch.int64, device=device)
        # per row since its request was admitted: rounds run and tokens they emitted (a request's accepted length)
        self.row_counts = torch.zeros(max_rows, 2, dtype=torch.int64, device=device)
        self.fill = BlockFill(longest, self.yields, self._round_bytes())
        self.rounds = self.bare_rounds = None
        # the drafters' bounds on the tokens waiting for their next forward: loosened before a probe (`_loosen`)
        self.waiting = _drafter_fields(drafter, "pending_bound") if draft_length is not None else []
        # the drafters' sizes of their last drafts (an accept's rollback bound): cleared before a round with drafts,
        # which sets them before its accept reads them. As a round graph's key they made each round after a draft of
        # another size a shape of its own, run eagerly after a warmup (emulated on the CPU: 14 of 41 rounds switching
        # γ between 4 and 2 every 3 rounds)
        self.last_drafts = _drafter_fields(drafter, "proposed") if draft_length is not None else []
        if graph_rounds:
            host, scope = self.graph_parts().host, state.runner.scope
            self.rounds = Graphs(self._kept, scope, host, state.timer.whole)
            if draft_length is not None:
                self.bare_rounds = Graphs(self._kept, scope, _bare_round_fields(host, self.waiting), state.timer.whole)

    def _take(self, gamma: int, tree: TreeShape | None) -> None:
        """Draft chains of `gamma` or, with `tree`, trees of that shape (then `gamma` is its depth)."""
        self.tree = tree
        self.gamma = gamma if tree is None else tree.depth
        self.tree_budget = 0 if tree is None else tree.budget  # a round graph's key: a chain or which tree

    def _round_bytes(self) -> int:
        """Weight bytes one round reads: every model of the drafter's stack γ times, the verifier once."""
        drafters = {id(m): m for m in self.drafter.graph_parts().modules}
        return weight_bytes(self.state.runner.module) + self.gamma * sum(map(weight_bytes, drafters.values()))

    def load_prompts(self, rows: torch.Tensor, prompts: list[list[int]]) -> None:
        self.state.load_prompts(rows, prompts)
        self.drafter.load_prompts(rows, prompts)
        self.acknowledged[rows] = self.state.seq_len[rows]

    def prefill(self, rows: torch.Tensor, features: StepOutput | None = None) -> None:
        step = self.state.forward(rows, leave_last=True, last_only=True)  # the drafter reads features, not logits
        self.drafter.prefill(rows, step if self.drafter.feature_layers else None)

    def propose(self, rows: torch.Tensor, k: int, at_most: bool = False) -> Proposal:
        """The k tokens after each row's acknowledged ones; `at_most` (a verifier above): up to k of them,
        with their full distributions, from a host-known number of cycles. Exactly k (an smc level above): a
        block fill, rows still short marked not `ready`; no host read either way."""
        if at_most:
            return self._draft(rows, k)
        for _ in range(self.fill.rounds(k)):
            self._cycle(rows, active=(self.state.seq_len[rows] - self.acknowledged[rows]) < k)
        self.ahead = k + self.gamma + 1
        start = self.acknowledged[rows]
        cols = (start[:, None] + torch.arange(k, device=rows.device)).clamp_max(self.state.capacity)
        return Proposal(
            tokens=self.state.seq[rows[:, None], cols],
            logq=self.seq_logq[rows[:, None], cols],
            logprobs=None,  # smc, the caller asking for exactly k, reads logq only
            ready=self.state.seq_len[rows] - start >= k,
        )

    def _draft(self, rows: torch.Tensor, k: int) -> Proposal:
        """Up to k tokens per row for a verifier above, with no host read. Such a caller always accepts what it
        was proposed, so no row holds surplus here and the cycles' distributions cover every handed position."""
        if self.rounds is not None:
            raise RuntimeError("a rejection level drafting for another must not graph its rounds (graph_rounds)")
        start = self.acknowledged[rows]
        torch._assert_async((self.state.seq_len[rows] == start).all(), "rejection drafter holds surplus tokens")
        cycles = -(-k // (self.gamma + 1))
        width = cycles * (self.gamma + 1)
        logprobs = None
        if not self.laws.greedy:
            vocab = self.state.runner.module.config.vocab_size
            logprobs = torch.zeros(len(rows), width + 1, vocab, device=rows.device)  # + a trash column
        for _ in range(cycles):
            base = self.state.seq_len[rows]
            _, logp = self._cycle(rows)
            if logprobs is not None:
                cols = (base - start)[:, None] + torch.arange(self.gamma + 1, device=rows.device)
                logprobs[torch.arange(len(rows), device=rows.device)[:, None], cols.clamp_max(width)] = logp
        self.ahead = width + 1
        count = (self.state.seq_len[rows] - start).clamp_max(k)
        cols = start[:, None] + torch.arange(k, device=rows.device)
        return Proposal(
            tokens=self.state.window(rows, start, count, k),
            logq=self.seq_logq[rows[:, None], cols.clamp_max(self.seq_logq.shape[1] - 1)],
            logprobs=None if logprobs is None else logprobs[:, :k],
            count=count,
        )

    def step(self, rows: torch.Tensor) -> Emission:
        """One draft/verify cycle for every row; all of its 1..γ+1 tokens are handed over."""
        choice = None
        if self.draft_length is not None:
            choice = self.draft_length.choose(rows.shape[0])
            # no round drafts again: the drafter need not follow the rows, and its backlog forces no drafting round
            self.idle_drafter = self.draft_length.drafters_out
            if choice == 0 and not self.idle_drafter and _backlog_full(self.waiting):
                choice = 1  # the drafter may leave no more tokens waiting (an EAGLE3 head's feature window)
            self._take(*self.draft_length.shape(choice))
            self.drafted, self.steps = self.drafted + self.gamma, self.steps + 1
        record = self._emitted(rows) if self.rounds is None else self._unit()(rows, None, emit=True)
        return Emission(record, self.gamma + 1, choice)

    def observe(self, arm: int, accepted: list[int]) -> None:
        """A step's read: each row kept `accepted` of the drafts of `draft_length`'s arm `arm`."""
        if self.draft_length is not None:
            self.draft_length.observe(arm, accepted)

    def commit(self, rows: torch.Tensor, n: int) -> None:
        self.acknowledged[rows] += n

    def accept(
        self,
        rows: torch.Tensor,
        keep_len: torch.Tensor,
        next_token: torch.Tensor,
        features: StepOutput | None = None,
        mask: torch.Tensor | None = None,
    ) -> None:
        acknowledged = keep_len + 1
        if mask is not None:  # a deferred row keeps its partial block: nothing was acknowledged
            acknowledged = torch.where(mask, acknowledged, self.acknowledged[rows])
        keep_len, next_token = masked_accept(self.state, rows, keep_len, next_token, mask)
        self.state.truncate(rows, keep_len, next_token, max_drop=self.ahead)
        self.drafter.accept(rows, keep_len, next_token)
        self.acknowledged[rows] = acknowledged

    def fork(self, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
        width = min(self.state.len_bound + 1, self.seq_logq.shape[1])
        logq, ack = self.seq_logq[src_rows, :width], self.acknowledged[src_rows]
        self.state.fork(src_rows, dst_rows)
        self.drafter.fork(src_rows, dst_rows)
        self.seq_logq[dst_rows, :width], self.acknowledged[dst_rows] = logq, ack

    def release(self, rows: torch.Tensor) -> None:
        self.state.release(rows)
        self.drafter.release(rows)
        self.row_counts.index_fill_(0, rows, 0)

    def row_counters(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """Each row's (rounds, tokens emitted) here and in the rejection levels below, top first."""
        return [self.row_counts[rows], *self.drafter.row_counters(rows)]

    def set_len_bound(self, bound: int) -> None:
        """`bound` holds for the level above; rows here may hold up to `ahead` tokens more (a block's surplus).
        Bound 0: no row holds anything, so none holds tokens ahead either."""
        ahead = self.ahead if bound else 0
        self.state.bound_lengths(bound + ahead)
        self.drafter.set_len_bound(bound + ahead)

    def graph_parts(self) -> GraphParts:
        """What a round touches (the level's own and those of the levels below)."""
        own = GraphParts(host=[HostField(self, n) for n in ("ahead", "gamma", "tree_budget", "idle_drafter")])
        return self.state.graph_parts() + self.laws.graph_parts() + self.drafter.graph_parts() + own

    def reset_stats(self) -> None:
        self.state.timer.reset()
        self.yields.zero_()
        self.fill.reset()
        self.drafted = self.steps = 0
        for unit in (self.rounds, self.bare_rounds):
            if unit is not None:
                unit.replays = 0

    def stats(self) -> dict[str, float]:
        """With graphed rounds `forward_seconds` / `forwards` time whole rounds (the drafter's steps included),
        and `graphed_rounds` counts the replays."""
        (yields,) = read_counters(self.yields)
        stats = {
            "mean_accepted_length": sum((i + 1) * n for i, n in enumerate(yields)) / max(sum(yields), 1),
            "forward_seconds": self.state.timer.seconds(),
            "forwards": self.state.timer.count,
        }
        if self.rounds is not None:
            stats["graphed_rounds"] = self.rounds.replays + (self.bare_rounds.replays if self.bare_rounds else 0)
        if self.fill.blocks:
            stats["mean_fill_rounds"] = self.fill.mean_rounds()
        if self.steps:
            stats["mean_draft_tokens"] = self.drafted / self.steps
        return stats

    def _cycle(
        self, rows: torch.Tensor, active: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One round (`_round`), replayed from a CUDA graph with `graph_rounds` (then without its distributions)."""
        if self.rounds is None:
            return self._round(rows, active)
        return self._unit()(rows, active), None

    def _unit(self) -> Graphs:
        """The graphed unit of the next round: rounds of γ = 0 have their own (`bare_rounds`)."""
        bare = self.gamma == 0 and self.tree is None and self.bare_rounds is not None
        if not bare and self.bare_rounds is not None:
            _loosen(self.waiting)
            for field in self.last_drafts:
                setattr(field.owner, field.name, 0)
        return self.bare_rounds if bare else self.rounds

    def _kept(self, rows: torch.Tensor, active: torch.Tensor | None = None, emit: bool = False) -> torch.Tensor:
        """A round's kept-draft counts alone: a graph keeps its outputs alive (the distributions would be
        R x (γ+1) x vocab floats per captured shape), and only a level drafting for another reads them. `emit`
        (a top's step): what the round emits instead (`_emitted`)."""
        return self._emitted(rows) if emit else self._round(rows, active)[0]

    def _emitted(self, rows: torch.Tensor) -> torch.Tensor:
        """A top's step: one round, the rows' new tokens acknowledged, then its record (`Emission`): tokens
        [R, γ+1] (0 past each row's count), their count, the counters. Inside the round's graph, so a step costs one
        replay on the host, as a model top's does, not one plus a launch for each of these small ops."""
        if self.gamma == 0 and self.tree is None:
            tokens, count = self._undrafted(rows)
        else:
            base = self.state.seq_len[rows]
            count = self._round(rows)[0] + 1
            tokens = self.state.window(rows, base, count, self.gamma + 1)
            self.acknowledged[rows] = self.state.seq_len[rows]
        return torch.cat([tokens, count[:, None], *self.row_counters(rows)], 1)

    def _undrafted(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A top's round of γ = 0 (`_emitted`), as a model top's step: one forward, one draw from p' (the sampler's
        pass gives the token alone: no level above reads its log-probability), the token appended, the drafters
        told it. A general round's log-softmax, rollbacks and hand-up records made a round of γ = 0 cost 1.14x the
        target's step on an H200 at T = 1 (`bench_draft_length --explain`), which `auto` pays on every such round."""
        base = self.state.seq_len[rows]
        step = self.state.forward(rows, last_only=True)
        keys = self.streams.keys(rows, self.residual_purpose, base)
        token, _ = self.laws.at(rows).sample(step.logits[:, 0].float(), keys)
        self.state.append(rows, token[:, None])
        if not self.idle_drafter:
            self.drafter.accept(rows, base, token, step if self.drafter.feature_layers else None)
        self.yields[0] += len(rows)
        self.row_counts[rows] += 1  # one round, one token
        self.acknowledged[rows] = base + 1
        return token[:, None], torch.ones_like(token)

    def _round(
        self, rows: torch.Tensor, active: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One draft + verify for `rows`; returns the number of drafts each row kept and, unless every row is
        greedy, the verifier's log p' at the γ+1 positions from the first draft's on [R, γ+1, V]. Rows where
        `active` is False run along but keep their state (their drafts are rolled back)."""
        if self.tree is not None:
            return self._tree_round(rows, active)
        gamma = self.gamma
        draft = self.drafter.propose(rows, gamma, at_most=True)  # γ >= 1: a top's round of γ = 0 is `_undrafted`
        base = self.state.seq_len[rows]  # the first draft's position
        self.state.append(rows, draft.tokens)
        step = self.state.forward(rows)
        p_logits = step.last(gamma + 1).float()  # p_1..p_{γ+1}
        law = self.laws.at(rows)
        logp = None if law.greedy else law.log_probs(p_logits)
        accepted, token = self._verify(rows, base, draft, p_logits, logp)
        self._settle(rows, base, draft.tokens, accepted, token, logp, active, gamma + 1, step)
        return accepted, logp

    def _tree_round(
        self, rows: torch.Tensor, active: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`_round` for a draft tree: the drafter's tree, ONE verifier forward over its nodes under a tree mask,
        the walk of `tree_rule`, and the accepted path's KV moved to the front of the tree's block (the rest
        rolled back, its slots freed). Its distributions are those along the accepted path."""
        shape = self.tree
        drawn = self.tree_rule in DRAWN_RULES
        law = self.laws.at(rows)
        # a greedy verifier keeps only its argmax, which the top-k of q holds more often than children drawn from q;
        # every rule is exact for any children under a one-hot p'
        tree = self.drafter.propose_tree(rows, shape, sampled=drawn and not law.greedy)
        base = self.state.seq_len[rows]  # the first draft's position
        start = base - 1  # the root's column in the verifier's KV
        seen = ancestors(tree, shape.depth)
        logits, features = self.state.forward_tree(rows, tree.tokens, tree.depth, seen)
        logp = law.log_probs(logits.float())  # [R, N, V]
        nodes = torch.arange(tree.size, device=rows.device)
        u = uniform(combine(self.streams.keys(rows, self.accept_purpose, start[:, None] + tree.depth), nodes)).float()
        q = tree.logq.exp() if drawn else None
        node, residual = self.laws.backend.tree_walk(
            self.tree_rule, tree.parent, tree.tokens, logp.exp(), q, u, max_children=shape.topk
        )
        accepted = tree.depth.gather(1, node[:, None])[:, 0]
        ones, no_floor = torch.ones_like(u[:, 0]), torch.full_like(u[:, 0], float("-inf"))
        keys = self.streams.keys(rows, self.residual_purpose, base + accepted)
        token, _ = self.laws.backend.gumbel_max(residual.log(), ones, no_floor, keys)
        on_path = path(tree, seen, node, shape.depth)
        kept = seen.gather(1, node[:, None, None].expand(-1, 1, tree.size))[:, 0]  # the root and the path
        self.state.runner.tables.permute(rows, start, torch.where(kept, tree.depth, tree.size + nodes).argsort(-1))
        drafts = tree.tokens.gather(1, on_path)
        self.state.place(rows, base, drafts, processed=True)
        self.drafter.state.place(rows, base, drafts)
        along = torch.cat([torch.zeros_like(node[:, None]), on_path], 1)  # the root, then the path
        index = torch.arange(len(rows), device=rows.device)[:, None]
        path_logp = logp[index, along]  # [R, depth + 1, V]
        step = None
        if self.drafter.feature_layers:  # the verifier's features at the root and the path, as a chain's verify
            step = StepOutput(path_logp, torch.full_like(base, shape.depth + 1), start, features[index, along])
        self._settle(rows, base, drafts, accepted, token, path_logp, active, tree.size, step)
        return accepted, path_logp

    def _settle(
        self,
        rows: torch.Tensor,
        base: torch.Tensor,
        drafts: torch.Tensor,
        accepted: torch.Tensor,
        token: torch.Tensor,
        logp: torch.Tensor | None,
        active: torch.Tensor | None,
        max_drop: int,
        step: StepOutput | None,
    ) -> None:
        """A round's outcome: `accepted` of `drafts` [R, γ] (from position `base`) kept and `token` after them;
        the verifier's log p' at those γ + 1 positions (`logp`; None: every row greedy) gives what is handed
        upward. Both models keep what was kept (the verifier's KV drops at most `max_drop` tokens); `step`: the
        verify forward, for a feature-reading drafter."""
        gamma = drafts.shape[1]
        if logp is None:
            emitted_logq = torch.zeros(len(rows), gamma + 1, device=rows.device)
        else:
            chosen = torch.cat([drafts, token[:, None]], 1)
            chosen.scatter_(1, accepted[:, None], token[:, None])
            emitted_logq = logp.gather(-1, chosen[..., None]).squeeze(-1)
        cols = (base[:, None] + torch.arange(gamma + 1, device=rows.device)).clamp_max(self.seq_logq.shape[1] - 1)
        self.seq_logq[rows[:, None], cols] = emitted_logq
        keep_len = base + accepted
        if active is not None:  # an idle row drops its drafts: it keeps its tokens, the last one pending again
            keep_len = torch.where(active, keep_len, base - 1)
            token = torch.where(active, token, self.state.seq[rows, base - 1])
        self.state.truncate(rows, keep_len, token, max_drop=max_drop)
        self.drafter.accept(rows, keep_len, token, step if self.drafter.feature_layers else None)
        ran = torch.ones_like(keep_len) if active is None else active.to(torch.int64)
        self.yields.index_add_(0, accepted, ran)
        self.row_counts.index_add_(0, rows, torch.stack([ran, ran * (accepted + 1)], 1))

    def _verify(
        self, rows: torch.Tensor, base: torch.Tensor, draft: Proposal, p_logits: torch.Tensor, logp: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Number of kept drafts per row [R] and the token that follows them [R], for drafts at positions base,
        base + 1, ... and the verifier's log p' there (`logp`; None: every row greedy). Positions past a row's
        draft count hold no draft (q = 0 there): a row that keeps all its drafts gets the bonus from p'. A greedy
        row's p' is one-hot, so the rule keeps drafts while they are the argmax and then takes it."""
        gamma = draft.tokens.shape[1]
        index = torch.arange(len(draft.tokens), device=draft.tokens.device)
        drafted = torch.ones_like(draft.tokens, dtype=torch.bool)
        if draft.count is not None:
            drafted = torch.arange(gamma, device=rows.device)[None, :] < draft.count[:, None]
        if logp is None:
            greedy = p_logits.argmax(-1)  # [R, γ+1]
            keep = ((greedy[:, :gamma] == draft.tokens) & drafted).to(torch.int64)
            accepted = keep.cumprod(1).sum(1)
            return accepted, greedy[index, accepted]
        ones, no_floor = torch.ones_like(p_logits[:, 0, 0]), torch.full_like(p_logits[:, 0, 0], float("-inf"))
        p = logp.exp()
        if draft.logprobs is None:  # deterministic drafts: q is one-hot at the draft
            q = torch.zeros_like(p[:, :gamma]).scatter_(-1, draft.tokens[..., None], 1.0)
        else:
            q = draft.logprobs.float().exp()
        q = q * drafted[..., None]
        p_d = p[:, :gamma].gather(-1, draft.tokens[..., None]).squeeze(-1)
        q_d = q.gather(-1, draft.tokens[..., None]).squeeze(-1)
        positions = base[:, None] + torch.arange(gamma, device=rows.device)
        u = uniform(self.streams.keys(rows, self.accept_purpose, positions)).float()
        keep = ((u * q_d < p_d) & drafted).to(torch.int64)  # u < min(1, p/q)
        accepted = keep.cumprod(1).sum(1)
        # residual at the first rejection, or p_{γ+1} when every draft was kept
        q_pad = torch.cat([q, torch.zeros_like(p[:, :1])], 1)
        residual = (p - q_pad).clamp_min(0)[index, accepted]
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p[index, accepted])
        keys = self.streams.keys(rows, self.residual_purpose, base + accepted)
        token, _ = self.laws.backend.gumbel_max(residual.log(), ones, no_floor, keys)
        return accepted, token


def _drafter_fields(drafter: Level, name: str) -> list[HostField]:
    """The host fields called `name` among the drafter's round-graph keys (its own and its drafters')."""
    return [f for f in drafter.graph_parts().host if f.name == name]


def _backlog_full(waiting: list[HostField]) -> bool:
    """Whether a drafter with a limit on the tokens it leaves waiting (`max_pending`) has reached it."""
    return any(getattr(f.owner, f.name) >= getattr(f.owner, "max_pending", math.inf) for f in waiting)


def _bare_round_fields(host: list[HostField], waiting: list[HostField]) -> list[HostField]:
    """The host ints of a round of γ = 0: the drafter does not run, so the tokens waiting for its next forward
    (`waiting`) only grow (one per round). As a key they would make every such round a new shape, none ever captured
    (on an H100 a 1 : 3 self-draft under `auto` decoded at 0.09-0.53x its target alone); as a count they do not.
    The drafters' `proposed` (the last draft's size, a bound on an accept's rollback) is a count too: such a round
    rolls nothing back, so one graph serves it after drafts of any size (as a key, a `model` drafter's rounds of
    γ = 0 after a probe of γ = 1 missed the warmup's graphs, captured after drafts of γ = 8)."""
    return [replace(f, role="count") if f in waiting or f.name == "proposed" else f for f in host]


def _loosen(waiting: list[HostField]) -> None:
    """Before a round with drafts: a drafter that sat out rounds of γ = 0 has as many tokens waiting, a number that
    as the round graph's key would make each such round (a probe of the choice) a new shape, run eagerly with its
    catch-up forward (that forward alone took 6-16 ms on an H200, a graphed SmolLM2 round ~1 ms). A bound may be
    loose: rounded up to a power of two it recurs and the round is captured, its catch-up padded to the bound.
    Bounds of 1 and 2 (after rounds with drafts) stay. A drafter whose backlog has a limit (`max_pending`: an EAGLE3
    head, whose bound is 0 after rounds with drafts) takes the limit, one shape for every probe."""
    for field in waiting:
        bound = getattr(field.owner, field.name)
        most = getattr(field.owner, "max_pending", None)
        if most is not None and bound:
            setattr(field.owner, field.name, most)
        elif bound > 2:
            setattr(field.owner, field.name, 1 << (bound - 1).bit_length())
