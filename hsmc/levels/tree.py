"""Draft trees: their shape, how they grow (EAGLE-2's dynamic tree), and what attention and the KV see of them.

A tree of a row has N nodes in creation order: node 0 is the root (the row's last token), every other node comes
after its parent and after its earlier siblings, so creation order is a topological order that keeps siblings in
the order they were drafted (what `hsmc.speculative.tree_verify` walks).

Growth (`grow`): the root's children are the drafter's top-k tokens; at every further depth the k best nodes of
the previous depth (the frontier, by cumulative draft log-probability) are expanded into k children each; in the
end the `budget` best nodes are kept. A child's score is its parent's plus the log-probability of its *slot*: the
i-th largest probability of the parent's law, whatever token fills the slot. With deterministic children (the
top-k, `target_only`) that is the token's own log-probability, EAGLE-2's score. With children drawn without
replacement (Gumbel-top-k, `draft_aware`) it keeps the shape a function of what precedes a node's children: a
slot's rank never depends on the tokens drawn for it or for later slots (their descendants score no higher), which
the exactness of recursive rejection sampling needs (docs/design.md, "Tree drafting"). Ties go to the earlier
node, so a kept node's ancestors and earlier siblings are kept too.

A chain of γ drafts is the tree of depth γ and top-k 1.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from hsmc.ops.batch import ForwardBatch
from hsmc.ops.counter_hash import combine

if TYPE_CHECKING:
    from hsmc.engine.random_streams import RowStreams
    from hsmc.engine.runner import ModelRunner
    from hsmc.engine.sampler import Law
    from hsmc.ops.backend import Backend


@dataclass(frozen=True)
class TreeShape:
    """What a rejection level drafts (config `tree`): `budget` nodes, at most `depth` deep, `topk` children per
    expanded node and `topk` nodes expanded per depth."""

    depth: int
    topk: int
    budget: int


@dataclass(frozen=True)
class Tree:
    """Draft trees of R rows, N nodes each (node 0 the root)."""

    parent: torch.Tensor  # int64 [R, N]; the root is its own parent
    tokens: torch.Tensor  # int64 [R, N]; the root's entry is the row's last token
    depth: torch.Tensor  # int64 [R, N]; the root is at depth 0
    logq: torch.Tensor | None  # float [R, N, V]: the drafter's law of each node's children (-inf where never
    # expanded); None in the trees `grow` hands to `expand` while it grows

    @property
    def size(self) -> int:
        return self.tokens.shape[1]


# Expand: (tree so far, frontier node ids [R, m]) -> the drafter's log-law of their children [R, m, V].
Expand = Callable[[Tree, torch.Tensor], torch.Tensor]
# Children: (depth of the children, parent node ids [R, m], their laws logq [R, m, V], k) -> k children per parent
# [R, m, k] and the slot log-probabilities (the k largest of logq, descending) [R, m, k]
Children = Callable[[int, torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


def top_children(depth: int, parents: torch.Tensor, logq: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k tokens of each law: a deterministic tree (`target_only`, a greedy drafter), torch's top-k on every
    device so that greedy trees on CUDA keep the CPU's tokens (ties included)."""
    top = logq.topk(k, dim=-1)
    return top.indices, top.values


def _best(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k best entries per row of scores [R, M], ties to the earlier entry."""
    return scores.sort(dim=-1, descending=True, stable=True).indices[:, :k]


def grow(
    root: torch.Tensor,
    root_logq: torch.Tensor,
    expand: Expand,
    depth: int,
    topk: int,
    budget: int,
    children: Children = top_children,
) -> Tree:
    """The tree of `budget` drafts after `root` [R] (the row's last token, its drafter law root_logq [R, V]).
    `expand` runs the drafter over frontier nodes; `children` picks each expanded node's (`keyed_children`: draws
    without replacement)."""
    rows, vocab = root_logq.shape
    device = root.device
    index = torch.arange(rows, device=device)[:, None]
    parent = torch.zeros(rows, 1, dtype=torch.int64, device=device)
    tokens, depths = root[:, None], torch.zeros_like(parent)
    scores = torch.zeros(rows, 1, device=device)
    # the laws of the expanded nodes only (entry 0: none, all -inf; 1: the root's); `law` maps each node to its own
    laws = [root_logq.new_full((rows, 1, vocab), float("-inf")), root_logq[:, None].float()]
    law = torch.ones_like(parent)
    frontier, frontier_logq = parent, laws[1]  # ids [R, m] and their laws [R, m, V]
    for d in range(1, depth + 1):
        if d > 1:
            frontier_logq = expand(Tree(parent, tokens, depths, None), frontier).float()
            first_law = sum(part.shape[1] for part in laws)
            law = law.scatter(
                1, frontier, first_law + torch.arange(frontier.shape[1], device=device).expand_as(frontier)
            )
            laws.append(frontier_logq)
        child_tokens, slot_logq = children(d, frontier, frontier_logq, topk)
        child_scores = (scores.gather(1, frontier)[:, :, None] + slot_logq).flatten(1)
        first = tokens.shape[1]
        parent = torch.cat([parent, frontier[:, :, None].expand_as(child_tokens).flatten(1)], 1)
        tokens = torch.cat([tokens, child_tokens.flatten(1)], 1)
        depths = torch.cat([depths, torch.full_like(child_tokens.flatten(1), d)], 1)
        scores = torch.cat([scores, child_scores], 1)
        law = torch.cat([law, torch.zeros_like(child_tokens.flatten(1))], 1)
        frontier = first + _best(child_scores, topk)
    keep = _best(scores[:, 1:], budget).sort(-1).values + 1  # creation order: topological, siblings in order
    keep = torch.cat([torch.zeros_like(keep[:, :1]), keep], 1)
    new_ids = torch.arange(keep.shape[1], device=device).expand_as(keep)
    renumber = torch.zeros_like(parent).scatter_(1, keep, new_ids)
    logq = torch.cat(laws, 1)[index, law.gather(1, keep)]
    return Tree(renumber.gather(1, parent.gather(1, keep)), tokens.gather(1, keep), depths.gather(1, keep), logq)


def ancestors(tree: Tree, max_depth: int) -> torch.Tensor:
    """bool [R, N, N]: entry [n, m] holds when m is n or one of its ancestors (`max_depth` bounds the depth).

    By pointer doubling: after k steps a node's row holds its 2^k nearest ancestors (itself included) and `jump` is
    its 2^k-th ancestor, so ceil(log2(max_depth + 1)) steps suffice. A drafter expanding a growing tree bounds the
    depth by the node count; stepping one ancestor at a time made that ~400 small launches a round of a 6 x 6 tree
    (docs/measurements/2026-11-30-h200-tree-auto-t1.txt)."""
    n = tree.size
    seen = torch.eye(n, dtype=torch.bool, device=tree.parent.device).expand(tree.parent.shape[0], n, n).clone()
    jump = tree.parent  # the root is its own parent: jumps past it stay there
    for _ in range(max(max_depth, 1).bit_length()):
        seen = seen | seen.gather(1, jump[:, :, None].expand(-1, -1, n))
        jump = jump.gather(1, jump)
    return seen


def path(tree: Tree, seen: torch.Tensor, node: torch.Tensor, max_depth: int) -> torch.Tensor:
    """The nodes from depth 1 down to `node` [R] (`seen`: `ancestors`), padded with `node`: [R, max_depth]."""
    n = tree.size
    on = seen.gather(1, node[:, None, None].expand(-1, 1, n))[:, 0] & (tree.depth >= 1)
    out = node[:, None].repeat(1, max_depth + 1)  # + a trash column
    ids = torch.arange(n, device=node.device).expand_as(on)
    return out.scatter_(1, torch.where(on, tree.depth - 1, max_depth), ids)[:, :max_depth]


def tree_mask(seen: torch.Tensor, start: torch.Tensor, max_context: int) -> torch.Tensor:
    """Attention mask [R, T, max_context] of T new tokens that are tree nodes, after a prefix of start[i] columns
    and a block of W tree nodes at columns start..start+W-1 (the new ones among them): `seen` [R, T, W] says which
    block columns each new token sees (its ancestors and itself)."""
    cols = torch.arange(max_context, device=start.device)
    prefix = cols[None, None, :] < start[:, None, None]
    offset = cols[None, :] - start[:, None]  # [R, L]
    width = seen.shape[-1]
    inside = (offset >= 0) & (offset < width)
    block = seen.gather(2, offset.clamp(0, width - 1)[:, None, :].expand(-1, seen.shape[1], -1))
    return prefix | (inside[:, None, :] & block)


def frontier_batch(
    runner: ModelRunner, rows: torch.Tensor, tree: Tree, frontier: torch.Tensor, run: torch.Tensor, bound: int
) -> ForwardBatch:
    """A drafter's forward of the frontier nodes [R, m], appended to its KV after the nodes it ran before in this
    tree (`run` [R, W], in column order, right after the root): each at RoPE position root + depth, seeing the
    prefix and its ancestors among them. `bound`: the rows' host-known length bound before the tree."""
    nodes = torch.cat([run, frontier], 1)
    seen = ancestors(tree, tree.size)
    index = torch.arange(len(rows), device=rows.device)[:, None, None]
    block = seen[index, frontier[:, :, None], nodes[:, None, :]]  # [R, m, W + m]
    width = frontier.shape[1]
    batch = runner.new_tokens(
        rows, tree.tokens.gather(1, frontier), torch.full_like(rows, width), bound + nodes.shape[1]
    )
    first = batch.start - run.shape[1]  # the column after the root
    positions = first[:, None] - 1 + tree.depth.gather(1, frontier)
    return replace(batch, positions=positions, mask=tree_mask(block, first, batch.max_context))


def tree_law(law: Law, logits: torch.Tensor) -> torch.Tensor:
    """A drafter's log-law of a node's children: log p' (what children drawn without replacement follow), or for a
    greedy drafter log_softmax(ℓ), which ranks its top-k children."""
    return torch.log_softmax(logits.float(), -1) if law.greedy else law.log_probs(logits)


def keyed_children(
    backend: Backend, streams: RowStreams, rows: torch.Tensor, purpose: int, start: torch.Tensor
) -> Children:
    """Children drawn without replacement (`Backend.draw_children`), the noise of the children of `parents` at
    depth d keyed by (row, purpose, position start + d - 1, parent): no two nodes of a tree share a draw, and a
    round never reuses one the kept tokens depend on."""

    def children(depth: int, parents: torch.Tensor, logq: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return backend.draw_children(logq, k, combine(streams.keys(rows, purpose, start + depth - 1)[:, None], parents))

    return children
