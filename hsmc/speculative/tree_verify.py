"""The exact verification of a draft tree (docs/design.md, "Tree drafting"): three rules.

A row's tree has N nodes: node 0 is the root (the row's last token, already verified), nodes 1..N-1 are drafts,
each after its parent (`parent[n] < n`) and siblings in the order they were drafted. `p[:, n]` is the verifier's
law of the token after node n, `q[:, n]` the drafter's law of node n's children. The walk starts at the root with
the residual r = p_root and tests the current node's children in order:

- candidate x is kept with probability min(1, r(x) / q_i(x)), where q_i is the law x was drawn from: q with the
  earlier (rejected) siblings removed, renormalised — children drawn *without replacement* (Gumbel-top-k);
- on rejection r ← norm(max(r − q_i, 0)) and the next sibling is tried;
- a kept child becomes the current node (r = p there, a fresh q); when no child is kept (or the node has
  none) the token after the current node is drawn from r.

`draft_aware` passes q: recursive rejection sampling without replacement (Jeon et al. 2024, "Recursive
Speculative Decoding"; SpecTr, Sun et al. 2023). `traversal` (`verify_tree_traversal`) verifies the same trees
leaf to root with sequence-level acceptance (Weng et al. 2025, "Traversal Verification"): a child whose ratio
p/q exceeds 1 makes up for an ancestor whose ratio fell short, so more of a drawn tree is kept. `target_only`
passes q = None: children are the drafter's deterministic top-k, so q_i is one-hot at x_i and the rule keeps x
with probability r(x) and otherwise zeroes it in r — the rule of EAGLE-2 and SGLang. A chain is the tree where
every node has one child. The emitted tokens are exactly distributed as p at any temperature; a greedy verifier
(one-hot p) keeps the children equal to its argmax, so the output is its greedy decode.

These walks step child by child and are the reference (`TorchBackend.tree_walk`); on a GPU the same walks run in a
few kernels over a closed form of the residual (`hsmc.ops.tree_walk`, `TritonBackend.tree_walk`).
"""

from __future__ import annotations

import torch

DRAWN_RULES = ("draft_aware", "traversal")  # the rules whose children are drawn without replacement from q


def verify_tree(
    parent: torch.Tensor, tokens: torch.Tensor, p: torch.Tensor, q: torch.Tensor | None, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The node the walk ends at [R] and the normalised law of the token after it [R, V].

    `parent`, `tokens`: int64 [R, N] (entry 0, the root, unused); `p`: float [R, N, V], normalised; `q`: float
    [R, N, V] (children drawn without replacement from it) or None (deterministic children); `u`: uniforms in
    (0, 1) [R, N], one per candidate. A candidate with no mass left under q_i was not drawn from it (the drafter
    ran out of tokens) and is skipped. Every row runs the same N - 1 steps: no host read."""
    rows, n_nodes = tokens.shape
    index = torch.arange(rows, device=tokens.device)
    cur = torch.zeros(rows, dtype=torch.int64, device=tokens.device)
    r = p[:, 0].float()
    mass = None if q is None else q[:, 0].float()  # what q has left at the current node (unnormalised)
    for n in range(1, n_nodes):
        x = tokens[:, n]
        if mass is None:
            q_i = torch.nn.functional.one_hot(x, r.shape[-1]).to(r.dtype)
        else:
            q_i = _normalised(mass)
        q_x = q_i[index, x]
        r_x = r[index, x]
        tested = (parent[:, n] == cur) & (q_x > 0)
        kept = tested & (u[:, n] * q_x < r_x)
        rejected = tested & ~kept
        left = (r - q_i).clamp_min(0)
        total = left.sum(-1, keepdim=True)
        left = torch.where(total > 0, left / total.clamp_min(1e-30), r)  # total 0: only if x had all of r's mass
        r = torch.where(rejected[:, None], left, r)
        if mass is not None:
            mass = torch.where(rejected[:, None], mass.scatter(1, x[:, None], 0.0), mass)
            mass = torch.where(kept[:, None], q[:, n].float(), mass)
        r = torch.where(kept[:, None], p[:, n].float(), r)
        cur = torch.where(kept, n, cur)
    return cur, r


def verify_tree_traversal(
    parent: torch.Tensor, tokens: torch.Tensor, p: torch.Tensor, q: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`verify_tree`'s result for trees whose children were drawn without replacement from q, by traversal
    verification: depth first, a node is entered with the weight a = min(1, a_parent · r_parent(x) / q_i(x)); a
    node without untried children is kept (with its path) with probability a, the next token drawn from its r;
    otherwise it leaves its parent's q and the parent's (a, r) become the residual of (a · r, stop 1 − a) against
    q_i: r ← norm(max(a·r − q_i, 0)), a ← R / (R + 1 − a) with R the residual's mass. That is recursive rejection
    sampling over the tokens and a "stop" symbol at every node (docs/design.md, "Tree drafting"); on a chain it is
    block verification. Every row runs the same 3N − 2 steps (enter, skip or decide): no host read."""
    rows, n_nodes = tokens.shape
    index = torch.arange(rows, device=tokens.device)
    weight = torch.ones(rows, n_nodes, device=p.device)
    r = p.float().clone()  # each node's law of the token after it, a residual once a child was rejected
    mass = q.float().clone()  # what each node's q has left (unnormalised)
    tried = torch.zeros(rows, n_nodes, dtype=torch.bool, device=tokens.device)
    tried[:, 0] = True
    cur = torch.zeros(rows, dtype=torch.int64, device=tokens.device)
    done = torch.zeros(rows, dtype=torch.bool, device=tokens.device)
    for _ in range(3 * n_nodes - 2):
        untried = (parent == cur[:, None]) & ~tried
        has_child = untried.any(-1)
        child = untried.to(torch.int8).argmax(-1)  # the first untried child, in draw order
        x = torch.where(has_child, tokens[index, child], 0)
        q_i = _normalised(mass[index, cur])
        q_x = q_i[index, x]
        a = weight[index, cur]
        step_in = ~done & has_child
        enter = step_in & (q_x > 0)  # no mass left under q_i: the drafter ran out of tokens, x was not drawn
        entered = (a * r[index, cur, x] / q_x.clamp_min(1e-30)).clamp_max(1.0)
        weight[index, child] = torch.where(enter, entered, weight[index, child])
        tried[index, child] = tried[index, child] | step_in
        decide = ~done & ~has_child
        kept = decide & (u[index, cur] < a)  # the root has weight 1: kept once its children are tried
        rejected = decide & ~kept
        done = done | kept
        # a rejected node leaves its parent's q; the parent's (weight, r) become the residual
        up = parent[index, cur]
        token = torch.where(cur > 0, tokens[index, cur], 0)
        a_up, r_up, mass_up = weight[index, up], r[index, up], mass[index, up]
        left = (a_up[:, None] * r_up - _normalised(mass_up)).clamp_min(0)
        total = left.sum(-1)
        stop = 1 - a_up
        r[index, up] = torch.where((rejected & (total > 0))[:, None], left / total.clamp_min(1e-30)[:, None], r_up)
        weight[index, up] = torch.where(rejected & (total + stop > 0), total / (total + stop).clamp_min(1e-30), a_up)
        mass[index, up] = torch.where(rejected[:, None], mass_up.scatter(1, token[:, None], 0.0), mass_up)
        cur = torch.where(enter, child, torch.where(rejected, up, cur))
    return cur, r[index, cur]


def _normalised(mass: torch.Tensor) -> torch.Tensor:
    return mass / mass.sum(-1, keepdim=True).clamp_min(1e-30)
