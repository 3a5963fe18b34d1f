"""Tree drafting in a `rejection` level: a greedy verifier gets its own greedy decode, a sampled one its exact
distribution (χ² of the first 3 tokens), and the KV keeps only the accepted paths."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model
from helpers import assert_greedy_as_target_with_partial_acceptance, assert_pools_empty
from test_rejection import VOCAB, _chi2_pvalue, _exact_first_tokens, _hf_greedy

from hsmc.decoder import HierarchicalDecoder
from hsmc.levels.tree import Tree, ancestors


def _tree_stack(draft, target, draft_t, target_t, rule, depth=4, topk=2, budget=8, draft_layers=None, **engine):
    return HierarchicalDecoder.from_config(
        {
            "levels": [
                {"kind": "model", "model": str(draft), "temperature": draft_t, "num_layers": draft_layers},
                {
                    "kind": "rejection",
                    "model": str(target),
                    "temperature": target_t,
                    "tree": {"depth": depth, "topk": topk, "budget": budget},
                    "tree_rule": rule,
                },
            ],
            "engine": {"kv_capacity_tokens": 4096, **engine},
        }
    )


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("tree") / "target", seed=2)


@pytest.mark.parametrize("rule,draft_t", [("target_only", 0.0), ("draft_aware", 1.0), ("traversal", 1.0)])
def test_tree_at_temperature_zero_equals_verifier_greedy(target, rule, draft_t):
    decoder = _tree_stack(target, target, draft_t, 0.0, rule, depth=4, topk=2, budget=8, draft_layers=3)
    assert_greedy_as_target_with_partial_acceptance(decoder, target, _hf_greedy)


@pytest.fixture(scope="module")
def small_eagle(tmp_path_factory):
    """A head whose top-2 often holds its verifier's argmax (verifier vocabulary 6, draft vocabulary 4)."""
    from test_eagle_level import make_small_vocab_pair

    return make_small_vocab_pair(tmp_path_factory.mktemp("tree-small-eagle"))


@pytest.mark.parametrize("kind", ["model", "eagle3"])
def test_draft_aware_under_a_greedy_verifier_drafts_the_top_k_tree_of_target_only(target, small_eagle, kind):
    """A greedy verifier keeps only its argmax, so under it draft_aware drafts the top-k of q, as target_only does
    (children drawn from q would only find the argmax less often): the same tokens, round by round the same
    accepted lengths."""
    verifier, head = small_eagle
    runs = {}
    for rule, draft_t in [("target_only", 0.0), ("draft_aware", 1.0)]:
        drafter = {"kind": "model", "model": str(target), "num_layers": 3, "temperature": draft_t}
        prompts = [[5, 9, 2], [7, 1]]
        if kind == "eagle3":
            drafter, prompts = {"kind": "eagle3", "model": str(head), "temperature": draft_t}, [[1, 4, 2], [3]]
        tree = {"tree": {"depth": 4, "topk": 2, "budget": 8}, "tree_rule": rule}
        decoder = _levels(drafter, verifier if kind == "eagle3" else target, **tree)
        results = decoder.generate(prompts, max_new_tokens=32, ignore_eos=True, seed=3)
        accepted = decoder.stack.top.yields.tolist()  # rounds by drafts kept
        runs[rule] = [r.token_ids for r in results], accepted, results[0].stats["levels"][1]["mean_accepted_length"]
    assert runs["draft_aware"] == runs["target_only"]
    assert runs["target_only"][2] > 1.1, "the trees' drafts should be used"


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    root = tmp_path_factory.mktemp("small-tree")
    return (
        make_tiny_model("llama", root / "draft", seed=3, vocab_size=VOCAB, eos_token_id=5),
        make_tiny_model("llama", root / "target", seed=4, vocab_size=VOCAB, eos_token_id=5),
    )


@pytest.mark.parametrize("rule", ["draft_aware", "traversal"])  # target_only: at the rule level (test_tree_verify.py)
def test_tree_stack_is_lossless_in_distribution(small_vocab, rule):
    draft, target = small_vocab
    prompt, n_samples = [1, 4, 2], 20_000
    decoder = _tree_stack(draft, target, 0.8, 1.0, rule, depth=2, topk=2, budget=4, max_batch_rows=2500)
    results = decoder.generate([prompt] * n_samples, max_new_tokens=3, ignore_eos=True, seed=11)
    samples = [tuple(r.token_ids) for r in results]
    assert _chi2_pvalue(samples, _exact_first_tokens(target, prompt, 3)) > 1e-3
    assert _chi2_pvalue(samples, _exact_first_tokens(draft, prompt, 3)) < 1e-6  # power
    assert results[0].stats["levels"][1]["mean_accepted_length"] > 1.2, "the trees' drafts should be used"
    assert_pools_empty(decoder)


@pytest.mark.parametrize("rule", ["target_only", "draft_aware", "traversal"])
def test_random_trees_keep_only_the_accepted_paths_kv(small_vocab, rule):
    """After every round of random trees and acceptances: the pool's invariants hold, each row's verifier KV is
    exactly its sequence but the pending token (the rejected branches' slots are free), and the verifier's KV
    entries are those of the sequence (its next logits equal transformers' over the whole sequence). One verifier
    forward per round, one drafter forward per depth."""
    from helpers import hf_logits, make_state
    from transformers import AutoModelForCausalLM

    from hsmc.engine.kv_pool import check_invariants
    from hsmc.engine.random_streams import RowStreams
    from hsmc.engine.sampler import RowLaws
    from hsmc.levels.model import ModelLevel
    from hsmc.levels.rejection import RejectionLevel
    from hsmc.levels.tree import TreeShape
    from hsmc.models.loading import load_model

    draft_path, target_path = small_vocab
    cpu, n_rows = torch.device("cpu"), 6
    streams = RowStreams(n_rows, cpu)
    streams.seed(torch.arange(n_rows), torch.arange(n_rows) + 7, torch.zeros(n_rows, dtype=torch.int64))
    drafter = ModelLevel(
        make_state(load_model(str(draft_path)).model, n_rows, 512), RowLaws(1.0, n_rows, cpu), streams, 1
    )
    verifier = make_state(load_model(str(target_path)).model, n_rows, 512)
    shape = TreeShape(depth=3, topk=3, budget=7)
    level = RejectionLevel(verifier, drafter, 0, RowLaws(1.0, n_rows, cpu), streams, 0, tree=shape, tree_rule=rule)
    rows = torch.arange(n_rows)
    level.load_prompts(rows, [[1, 4, 2], [3], [0, 1, 2, 3, 4], [2, 2], [5, 1, 0], [4]])
    level.prefill(rows)
    tables = verifier.runner.tables
    forwards, draft_forwards = verifier.timer.count, drafter.state.timer.count
    for _ in range(8):
        level.step(rows)
        check_invariants(tables.allocator, [tables])
        check_invariants(drafter.state.runner.tables.allocator, [drafter.state.runner.tables])
        assert (tables.length[rows] == verifier.seq_len[rows] - 1).all()
        assert tables.allocator.num_slots - tables.allocator.num_free() == int(tables.length.sum())
    assert level.stats()["mean_accepted_length"] > 1.2
    assert verifier.timer.count - forwards == 8, "one verifier forward per round"
    assert drafter.state.timer.count - draft_forwards == 8 * shape.depth, "one drafter forward per depth"
    hf = AutoModelForCausalLM.from_pretrained(target_path, dtype=torch.float32).eval()
    logits = verifier.forward(rows, last_only=True).logits[:, 0]
    for row in rows.tolist():
        expected = hf_logits(hf, verifier.seq[row, : int(verifier.seq_len[row])].tolist())[-1]
        assert (logits[row] - expected).abs().max() < 1e-4, row
    level.release(rows)
    assert tables.allocator.num_free() == tables.allocator.num_slots


@pytest.mark.parametrize("rule", ["draft_aware", "traversal"])
def test_tree_level_under_smc_hands_up_its_own_model_probabilities(small_vocab, rule):
    """[model, tree rejection, smc] with the smc target equal to the rejection level's model and α = 1: the
    proposal is the target itself, so every weight is zero — the log-probabilities handed up along the accepted
    paths are the verifier's own (the SMC proposal law is unchanged by the tree)."""
    draft, target = small_vocab
    decoder = HierarchicalDecoder.from_config(
        {
            "levels": [
                {"kind": "model", "model": str(draft), "temperature": 1.0},
                {
                    "kind": "rejection",
                    "model": str(target),
                    "temperature": 1.0,
                    "tree": {"depth": 3, "topk": 2, "budget": 5},
                    "tree_rule": rule,
                },
                {"kind": "smc", "model": str(target), "temperature": 1.0, "particles": 4, "block_size": 3},
            ],
            "engine": {"kv_capacity_tokens": 8192, "max_batch_rows": 16},
        }
    )
    for result in decoder.generate([[1, 2, 0]] * 3, max_new_tokens=10, ignore_eos=True):
        assert max(abs(p.log_weight) for p in result.smc.particles) < 1e-4
    assert decoder.stack.levels[1].stats()["mean_accepted_length"] > 1.2
    assert_pools_empty(decoder)


@pytest.fixture(scope="module")
def eagle(tmp_path_factory):
    from test_eagle_checkpoint import published_layout
    from test_eagle_level import SIZES

    root = tmp_path_factory.mktemp("tree-eagle")
    verifier = make_tiny_model("llama", root / "verifier", seed=2)
    head, _ = published_layout(root / "head", dtype=torch.float32, sizes=(*SIZES, 101, 40), scale=0.3)
    return head, verifier


def _levels(drafter: dict, verifier, **rejection) -> HierarchicalDecoder:
    levels = [drafter, {"kind": "rejection", "model": str(verifier), "temperature": 0.0, **rejection}]
    return HierarchicalDecoder.from_config({"levels": levels, "engine": {"kv_capacity_tokens": 4096}})


@pytest.mark.parametrize("kind", ["model", "eagle3"])
def test_top_k_one_tree_drafts_and_keeps_what_the_greedy_chain_does(target, eagle, kind):
    """A greedy drafter's tree of top-k 1 is its greedy chain: the same drafts, so the same kept counts, through
    the tree's masked forwards (the EAGLE3 head fed its parents' outputs, the verifier's features along the path)."""
    head, verifier = eagle
    if kind == "model":
        drafter, verifier = {"kind": "model", "model": str(target), "num_layers": 3}, target
    else:
        drafter = {"kind": "eagle3", "model": str(head)}
    prompts = [[5, 9, 13], [7] * 11, [40, 41, 42, 43, 44, 45], [3]]
    chain = _levels(drafter, verifier, num_draft_tokens=3)
    tree = _levels(drafter, verifier, tree={"depth": 3, "topk": 1, "budget": 3})
    wide = _levels(drafter, verifier, tree={"depth": 4, "topk": 3, "budget": 12})
    drafts = {"chain": [], "tree": []}
    propose, propose_tree = chain.stack.levels[0].propose, tree.stack.levels[0].propose_tree

    def chain_drafts(*args, **kwargs):
        proposal = propose(*args, **kwargs)
        drafts["chain"].append(proposal.tokens.clone())
        return proposal

    def tree_drafts(*args, **kwargs):
        grown = propose_tree(*args, **kwargs)
        drafts["tree"].append(grown.tokens[:, 1:].clone())
        return grown

    chain.stack.levels[0].propose, tree.stack.levels[0].propose_tree = chain_drafts, tree_drafts
    results = [d.generate(prompts, max_new_tokens=20, ignore_eos=True) for d in (chain, tree, wide)]
    for prompt, *outputs in zip(prompts, *results):
        assert all(o.token_ids == _hf_greedy(verifier, prompt, 20) for o in outputs)
    assert len(drafts["chain"]) == len(drafts["tree"]) > 5
    assert all((c == t).all() for c, t in zip(drafts["chain"], drafts["tree"]))
    counts = [r[0].stats["levels"][1]["mean_accepted_length"] for r in results]
    assert counts[0] == counts[1]
    assert counts[2] >= counts[0]
    for decoder in (chain, tree, wide):
        assert_pools_empty(decoder)


def test_tree_level_drafting_for_another_rejection_level_hands_up_its_path(target):
    """[model, tree rejection (target cut to 3 layers), rejection target at T = 0]: the tree level's output along
    its accepted paths (and its model's distributions there) are the drafts the top verifies."""
    draft = {"kind": "model", "model": str(target), "temperature": 1.0, "num_layers": 2}
    middle = {
        "kind": "rejection",
        "model": str(target),
        "temperature": 1.0,
        "num_layers": 3,
        "tree": {"depth": 3, "topk": 2, "budget": 5},
        "tree_rule": "draft_aware",
    }
    top = {"kind": "rejection", "model": str(target), "temperature": 0.0, "num_draft_tokens": 5}
    decoder = HierarchicalDecoder.from_config({"levels": [draft, middle, top], "engine": {"kv_capacity_tokens": 8192}})
    prompts = [[5, 9, 13], [7] * 11]
    results = decoder.generate(prompts, max_new_tokens=20, ignore_eos=True)
    for prompt, result in zip(prompts, results):
        assert result.token_ids == _hf_greedy(target, prompt, 20)
    assert results[0].stats["levels"][1]["mean_accepted_length"] > 1.2
    assert_pools_empty(decoder)


def test_draft_aware_keeps_every_child_drawn_from_the_verifiers_own_law(target):
    """A drafter that is the verifier (q = p at T = 1): draft_aware keeps its first child at every node, so a
    chain-shaped tree is always kept whole; target_only, blind to q, keeps a top-k child only with probability p."""
    shape = {"depth": 4, "topk": 1, "budget": 4}
    accepted = {}
    for rule in ("draft_aware", "target_only"):
        decoder = _tree_stack(target, target, 1.0, 1.0, rule, **shape)
        results = decoder.generate([[5, 9, 13], [7] * 11], max_new_tokens=30, ignore_eos=True)
        accepted[rule] = results[0].stats["levels"][1]["mean_accepted_length"]
    assert accepted["draft_aware"] == 5.0
    assert accepted["target_only"] < 2.0


@pytest.mark.parametrize(
    "kind,rule", [("model", "target_only"), ("model", "draft_aware"), ("eagle3", "draft_aware"), ("model", "traversal")]
)
def test_graphed_tree_rounds_decode_as_eager_ones(target, eagle, kind, rule, monkeypatch):
    """A tree round is one graph per shape on CUDA (captures emulated here: the graph's replay runs the round
    again with its inputs copied in and its host ints moved by the amounts its first run measured). A seeded T = 1
    batch decodes the same tokens through replayed tree rounds as eagerly, and the KV keeps only the paths."""
    from test_round_graphs import _emulated_capture

    from hsmc.engine.graphs import Graphs

    head, verifier = eagle
    drafter = {"kind": "model", "model": str(target), "num_layers": 3, "temperature": 1.0}
    if kind == "eagle3":
        drafter = {"kind": "eagle3", "model": str(head), "temperature": 1.0}
    else:
        verifier = target
    tree = {"tree": {"depth": 3, "topk": 2, "budget": 5}, "tree_rule": rule, "temperature": 1.0}
    prompts = [[5, 9, 13], [7] * 11, [40, 41, 42]]

    def decode(graphed: bool) -> tuple[list[list[int]], HierarchicalDecoder]:
        decoder = _levels(drafter, verifier, **tree)
        level = decoder.stack.top
        if graphed:
            level.rounds = Graphs(level._kept, decoder.stack.scope, level.graph_parts().host, level.state.timer.whole)
        results = [decoder.generate(prompts, max_new_tokens=24, ignore_eos=True, seed=7) for _ in range(2)]
        return [r.token_ids for r in results[-1]], decoder

    eager, _ = decode(False)
    monkeypatch.setattr(Graphs, "_capture", _emulated_capture)
    graphed, decoder = decode(True)
    assert graphed == eager
    assert decoder.stack.top.rounds.replays > 0
    assert_pools_empty(decoder)


def test_ancestors_are_each_nodes_path_to_the_root_for_any_depth_bound():
    """`ancestors` (pointer doubling) against walking each node's parents: the same matrix for trees of every depth,
    with the bound the rejection level gives (the depth) and the one a drafter gives while growing (the node count)."""
    g = torch.Generator().manual_seed(0)
    for _ in range(60):
        rows, n = 2, int(torch.randint(1, 40, (1,), generator=g))
        parent = torch.zeros(rows, n, dtype=torch.int64)
        for node in range(1, n):
            parent[:, node] = torch.randint(0, node, (rows,), generator=g)
        want = torch.zeros(rows, n, n, dtype=torch.bool)
        depth = torch.zeros(rows, n, dtype=torch.int64)
        for r in range(rows):
            for node in range(n):
                m = node
                want[r, node, m] = True
                while m != 0:
                    m = int(parent[r, m])
                    want[r, node, m] = True
                    depth[r, node] += 1
        tree = Tree(parent, torch.zeros_like(parent), depth, None)
        for bound in (int(depth.max()), n):
            assert torch.equal(ancestors(tree, bound), want)
