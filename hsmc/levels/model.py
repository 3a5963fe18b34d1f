"""`model` level: ancestral sampling from one model (the bottom of a stack, or a streaming top)."""

from __future__ import annotations

import torch

from hsmc.engine.graphs import GraphParts, Graphs, HostField
from hsmc.engine.random_streams import DRAW, RowStreams, purpose_of
from hsmc.engine.sampler import RowLaws
from hsmc.levels.base import Emission, Proposal, SequenceState, StepOutput, masked_accept
from hsmc.levels.tree import Tree, TreeShape, frontier_batch, grow, keyed_children, top_children, tree_law


class ModelLevel:
    feature_layers: tuple[int, ...] = ()  # ancestral sampling reads no verifier features
    step_growth = 1
    fill = None  # drafts exactly what it is asked for: no block fill

    def __init__(
        self, state: SequenceState, laws: RowLaws, streams: RowStreams, salt: int, graph_steps: bool = False
    ) -> None:
        """`laws`: each row's sampling law; `streams`: the stack's per-row random streams; `salt`: this level's
        depth under the top of the stack (its draws' purpose). `graph_steps` (a top on CUDA): a step — the
        forward, the sampling and the bookkeeping — replays as one CUDA graph. With only its forward graphed, a
        SmolLM2 step took ~2 ms of launches where a rejection top's round of γ = 0, the same work graphed whole,
        took 0.8 ms (H200; docs/measurements/2026-11-28-h200-auto-draft-length.txt)."""
        self.state = state
        self.laws = laws
        self.streams = streams
        self.draw = purpose_of(salt, DRAW)
        self.proposed = 0  # tokens handed up by the last propose: bounds the next accept's rollback
        self.steps: Graphs | None = None
        if graph_steps:
            self.steps = Graphs(self._sampled, state.runner.scope, self.graph_parts().host, state.timer.whole)

    def load_prompts(self, rows: torch.Tensor, prompts: list[list[int]]) -> None:
        self.state.load_prompts(rows, prompts)

    def prefill(self, rows: torch.Tensor, features: StepOutput | None = None) -> None:
        """Process the prompt but its last token, which stays pending for the first step."""
        self.state.forward(rows, leave_last=True, last_only=True)

    def propose(self, rows: torch.Tensor, k: int, at_most: bool = False) -> Proposal:
        law = self.laws.at(rows)
        tokens, logq, logprobs = [], [], []
        for _ in range(k):
            last = self.state.forward(rows, last_only=True).logits[:, 0]
            tok, lp = law.sample(last, self.streams.keys(rows, self.draw, self.state.seq_len[rows]))
            self.state.append(rows, tok[:, None])
            tokens.append(tok)
            logq.append(lp)
            if not law.greedy and at_most:  # a verifier above needs q(·); smc reads logq alone
                logprobs.append(law.log_probs(last))
        self.proposed = k
        return Proposal(
            tokens=torch.stack(tokens, 1),
            logq=torch.stack(logq, 1),
            logprobs=torch.stack(logprobs, 1) if logprobs else None,
        )

    def propose_tree(self, rows: torch.Tensor, shape: TreeShape, sampled: bool) -> Tree:
        """Each depth's frontier runs as one forward of its nodes (`frontier_batch`); those KV entries are rolled
        back at the end, so the accepted path is processed again with the next round's first forward, as a
        chain's last draft is."""
        law = self.laws.at(rows)
        root_logits = self.state.forward(rows, last_only=True).logits[:, 0]
        state, runner = self.state, self.state.runner
        start = state.kv_len[rows]  # the first node's column and the position of the first draft
        run = torch.zeros(len(rows), 0, dtype=torch.int64, device=rows.device)  # nodes in the KV past the root

        def expand(tree: Tree, frontier: torch.Tensor) -> torch.Tensor:
            nonlocal run
            with state.timer():
                logits, _ = runner.forward(frontier_batch(runner, rows, tree, frontier, run, state.len_bound))
            run = torch.cat([run, frontier], 1)
            return tree_law(law, logits)

        children = keyed_children(law.backend, self.streams, rows, self.draw, start) if sampled else top_children
        root = state.seq[rows, start - 1]
        tree = grow(root, tree_law(law, root_logits), expand, shape.depth, shape.topk, shape.budget, children)
        runner.tables.truncate(rows, start, max_drop=(shape.depth - 1) * shape.topk)
        self.proposed = shape.depth  # the accepted path: at most `depth` tokens past the root
        return tree

    def step(self, rows: torch.Tensor) -> Emission:
        tokens = self._sampled(rows) if self.steps is None else self.steps(rows)
        return Emission(torch.nn.functional.pad(tokens, (0, 1), value=1), 1)  # one token, its count

    def _sampled(self, rows: torch.Tensor) -> torch.Tensor:
        """A top's step: one token [R, 1] for each row."""
        return self.propose(rows, 1).tokens

    def commit(self, rows: torch.Tensor, n: int) -> None:
        """Nothing to do: a model level never proposes more than it was asked for."""

    def accept(
        self,
        rows: torch.Tensor,
        keep_len: torch.Tensor,
        next_token: torch.Tensor,
        features: StepOutput | None = None,
        mask: torch.Tensor | None = None,
    ) -> None:
        keep_len, next_token = masked_accept(self.state, rows, keep_len, next_token, mask)
        self.state.truncate(rows, keep_len, next_token, max_drop=self.proposed + 1)

    def fork(self, src_rows: torch.Tensor, dst_rows: torch.Tensor) -> None:
        self.state.fork(src_rows, dst_rows)

    def release(self, rows: torch.Tensor) -> None:
        self.state.release(rows)

    def row_counters(self, rows: torch.Tensor) -> list[torch.Tensor]:
        return []

    def set_len_bound(self, bound: int) -> None:
        self.state.bound_lengths(bound)

    def graph_parts(self) -> GraphParts:
        return self.state.graph_parts() + self.laws.graph_parts() + GraphParts(host=[HostField(self, "proposed")])

    def reset_stats(self) -> None:
        self.state.timer.reset()
        if self.steps is not None:
            self.steps.replays = 0

    def stats(self) -> dict[str, float]:
        """With graphed steps `forward_seconds` / `forwards` time whole steps, and `graphed_steps` counts the
        replays."""
        stats = {"forward_seconds": self.state.timer.seconds(), "forwards": self.state.timer.count}
        if self.steps is not None:
            stats["graphed_steps"] = self.steps.replays
        return stats
