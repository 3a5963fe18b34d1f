"""The exact verification of a draft tree (docs/design.md, "Tree drafting"): one walk, two rules.

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
Speculative Decoding"; SpecTr, Sun et al. 2023). `target_only` passes q = None: children are the drafter's
deterministic top-k, so q_i is one-hot at x_i and the rule keeps x with probability r(x) and otherwise zeroes it
in r — the rule of EAGLE-2 and SGLang. A chain is the tree where every node has one child. The emitted tokens are
exactly distributed as p at any temperature; a greedy verifier (one-hot p) keeps the children equal to its
argmax, so the output is its greedy decode.
"""

from __future__ import annotations

import torch


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
            q_i = mass / mass.sum(-1, keepdim=True).clamp_min(1e-30)
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
