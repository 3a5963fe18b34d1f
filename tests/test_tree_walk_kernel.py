"""The tree walk's kernels (`hsmc.ops.tree_walk`, the CUDA path of a tree round) against the reference walks of
`hsmc.speculative.tree_verify`, whose exactness `test_tree_verify` checks: given the same trees, laws and uniforms
they stop at the same node and leave the same residual law, for every rule, on trees grown as a level grows them,
on trees with a repeated sibling and with a child the drafter gave no mass, on a greedy target, and over a
vocabulary that spans several blocks. Without a GPU they run through Triton's interpreter (conftest)."""

from __future__ import annotations

import pytest
import torch
from helpers import drawn_children

pytest.importorskip("triton")

from hsmc.levels.tree import Tree, grow, top_children  # noqa: E402
from hsmc.ops.tree_walk import tree_walk  # noqa: E402
from hsmc.speculative.tree_verify import DRAWN_RULES, verify_tree, verify_tree_traversal  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RULES = ("target_only", "draft_aware", "traversal")


def _grown(rule: str, rows: int, vocab: int, depth: int, topk: int, budget: int, seed: int) -> Tree:
    """A tree per row grown as a rejection level grows it: children drawn without replacement from a random
    drafter law for the drawn rules, the drafter's top-k for target_only."""
    g = torch.Generator().manual_seed(seed)
    laws = 2.0 * torch.randn(16, vocab, generator=g)  # the drafter's logits after each token (modulo 16)

    def expand(tree: Tree, frontier: torch.Tensor) -> torch.Tensor:
        return laws[tree.tokens.gather(1, frontier) % 16].log_softmax(-1)

    root = torch.randint(0, vocab, (rows,), generator=g)
    children = drawn_children(g) if rule in DRAWN_RULES else top_children
    return grow(root, laws[root % 16].log_softmax(-1), expand, depth, topk, budget, children)


def _target(tree: Tree, vocab: int, seed: int, greedy: bool = False) -> torch.Tensor:
    """A target law at every node, close enough to the drafter's that drafts are kept [R, N, V]."""
    g = torch.Generator().manual_seed(seed + 1)
    logits = tree.logq.clamp_min(-30.0) + 1.5 * torch.randn(*tree.logq.shape, generator=g)
    if greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), vocab).float()
    return logits.softmax(-1)


def _assert_same_walk(rule, parent, tokens, p, q, u, max_children):
    reference = verify_tree_traversal if rule == "traversal" else verify_tree
    want_node, want_residual = reference(parent, tokens, p, q, u)
    moved = [t if t is None else t.to(DEVICE) for t in (parent, tokens, p, q, u)]
    node, residual = tree_walk(rule, *moved, max_children=max_children)
    assert node.cpu().tolist() == want_node.tolist()
    torch.testing.assert_close(residual.cpu(), want_residual, atol=2e-6, rtol=1e-4)
    return want_node


@pytest.mark.parametrize("rule", RULES)
def test_kernel_walk_equals_the_reference_on_grown_trees(rule):
    vocab, rows, topk = 29, 12, 3
    tree = _grown(rule, rows, vocab, depth=3, topk=topk, budget=8, seed=3)
    p = _target(tree, vocab, seed=3)
    q = tree.logq.exp() if rule in DRAWN_RULES else None
    u = torch.rand(rows, tree.size, generator=torch.Generator().manual_seed(5))
    node = _assert_same_walk(rule, tree.parent, tree.tokens, p, q, u, topk)
    assert 0 < int((node > 0).sum()) < rows  # drafts kept in some rows, not all: both ends of the walk ran


@pytest.mark.parametrize("rule", RULES)
def test_kernel_walk_skips_a_repeated_sibling_and_a_child_without_drafter_mass(rule):
    """Row 0: node 2 repeats its sibling node 1's token; row 1: the drafter gave node 3's token no mass. Both are
    skipped by the reference (no mass left under q_i); the closed form must skip them too. The first children's
    tokens are those the target wants least against q, so that walks get past them."""
    vocab, topk = 11, 3
    parent = torch.tensor([[0, 0, 0, 1, 1, 2], [0, 0, 0, 0, 3, 3]])
    g = torch.Generator().manual_seed(7)
    q = (0.5 * torch.randn(2, 6, vocab, generator=g)).softmax(-1)
    q[1, 0, 9] = 0.0
    q = q / q.sum(-1, keepdim=True)
    p = (0.5 * torch.randn(2, 6, vocab, generator=g)).softmax(-1)
    worst = (p[:, 0] / q[:, 0].clamp_min(1e-9)).argsort(-1)  # the root's tokens, least wanted first
    tokens = torch.tensor([[4, 0, 0, 1, 2, 3], [4, 0, 0, 9, 2, 5]])
    tokens[0, 1:3] = worst[0, 0]
    tokens[1, 1:3] = worst[1, :2]  # not 9: q(9) = 0 puts it last
    copies = 24  # each tree under many uniforms
    u = torch.rand(2 * copies, 6, generator=g)
    q = None if rule == "target_only" else q.repeat(copies, 1, 1)
    rows = (parent.repeat(copies, 1), tokens.repeat(copies, 1), p.repeat(copies, 1, 1))
    node = _assert_same_walk(rule, *rows, q, u, topk)
    assert 0 in node[0::2].tolist() and 0 in node[1::2].tolist()  # walks that tested node 2 (row 0), node 3 (row 1)


@pytest.mark.parametrize("rule", RULES)
def test_kernel_walk_keeps_the_greedy_path_of_a_one_hot_target(rule):
    vocab, rows, topk = 23, 8, 2
    tree = _grown(rule, rows, vocab, depth=4, topk=topk, budget=7, seed=11)
    p = _target(tree, vocab, seed=11, greedy=True)
    q = tree.logq.exp() if rule in DRAWN_RULES else None
    u = torch.rand(rows, tree.size, generator=torch.Generator().manual_seed(2))
    _assert_same_walk(rule, tree.parent, tree.tokens, p, q, u, topk)


@pytest.mark.parametrize("rule", ["draft_aware", "traversal"])
def test_kernel_walk_sums_the_residual_over_several_vocabulary_blocks(rule):
    vocab, rows, topk = 9000, 3, 2  # 4 blocks of 3072 entries: the third short, the fourth empty
    tree = _grown(rule, rows, vocab, depth=2, topk=topk, budget=4, seed=13)
    p = _target(tree, vocab, seed=13)
    u = torch.rand(rows, tree.size, generator=torch.Generator().manual_seed(1))
    _assert_same_walk(rule, tree.parent, tree.tokens, p, tree.logq.exp(), u, topk)
