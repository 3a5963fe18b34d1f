"""`num_draft_tokens: auto`: the choice of each round's γ, its timing at start, and exactness whatever γ it picks."""

from __future__ import annotations

import itertools
import math
import random
import time
from unittest import mock

import pytest
from helpers import assert_pools_empty
from test_eagle_level import small_vocab, verifier_and_head  # noqa: F401
from test_rejection import _chi2_pvalue, _exact_first_tokens, _hf_greedy, pair, small_vocab_pair  # noqa: F401

from hsmc.config import AUTO_MOST_DRAFTS, load_config
from hsmc.decoder import TIMING_DEEPEST_ROUNDS, HierarchicalDecoder
from hsmc.errors import ConfigError
from hsmc.levels.draft_length import DRAFT_MARGIN, IDLE_EVIDENCE, PROBE_SHARE, DraftLength, expected_tokens
from hsmc.levels.tree import TreeShape
from hsmc.requests import SamplingParams

PICKS = [0, 3, 0, 0, 1, 8, 2, 0, 5, 4, 0, 7, 6, 1]  # a schedule that visits every γ, 0 (the target alone) often
# round times at 1 row (γ = 0..8) of an H200, SmolLM2 and its EAGLE3 head in fp32: at α = 0.5 no γ pays
IDLE_MS = (0.75, 2.03, 2.40, 2.14, 2.31, 2.63, 2.84, 2.95, 10.3)
TREE_PICKS = [9, 0, 12, 3, 10, 0, 11, 1, 12, 9]  # with tree: auto, arms 9..12 are AUTO_TREES' trees
SMALL_TREE_PICKS = [9, 0, 10, 3, 9, 1, 10]  # the trees of budget 4 and 8 (the χ² of 20 000 rows is the costly test)


def _auto_stack(
    drafter: dict,
    target,
    target_t: float,
    rows: int = 16,
    tree: str | None = None,
    rule: str = "target_only",
    timed: bool = True,
    capacity: int = 4096,
) -> HierarchicalDecoder:
    """`timed=False`: without the start-up timing, for tests that force the shapes (`_scheduled`)."""
    top = {"kind": "rejection", "model": str(target), "temperature": target_t, "num_draft_tokens": "auto"}
    levels = [drafter, {**top, "tree": tree, "tree_rule": rule}]
    config = {"levels": levels, "engine": {"kv_capacity_tokens": capacity, "max_batch_rows": rows}}
    if timed:
        return HierarchicalDecoder.from_config(config)
    with mock.patch.object(HierarchicalDecoder, "_time_rounds", lambda self, level: None):
        return HierarchicalDecoder.from_config(config)


def _scheduled(decoder: HierarchicalDecoder, picks: list[int]) -> list[int]:
    """Make the level take γ from `picks` round after round (as any history-dependent choice may); the γs taken."""
    taken: list[int] = []
    schedule = itertools.cycle(picks)

    def choose(rows: int) -> int:
        taken.append(next(schedule))
        return taken[-1]

    decoder.stack.top.draft_length.choose = choose
    return taken


def _graphed_auto_stack(models, monkeypatch, drafter: str = "model", **options) -> HierarchicalDecoder:
    """A greedy [drafter, rejection auto] stack of the (draft, target) `models` (`drafter` eagle3: (verifier,
    head)) whose rounds are graphed units as on CUDA, their captures emulated on the CPU (an emulated graph replays
    by running the round again)."""
    from test_round_graphs import _emulated_capture

    from hsmc.engine.graphs import Graphs
    from hsmc.levels.rejection import _bare_round_fields

    monkeypatch.setattr(Graphs, "_capture", _emulated_capture)
    if drafter == "eagle3":
        target, draft = models
    else:
        draft, target = models
    decoder = _auto_stack({"kind": drafter, "model": str(draft)}, target, 0.0, timed=False, **options)
    level, scope = decoder.stack.top, decoder.stack.scope
    host, whole = level.graph_parts().host, level.state.timer.whole
    level.rounds = Graphs(level._kept, scope, host, whole)
    level.bare_rounds = Graphs(level._kept, scope, _bare_round_fields(host, level.waiting), whole)
    return decoder


def test_expected_tokens_is_the_geometric_sum():
    for rate, gamma in [(0.0, 3), (0.5, 0), (0.7, 4), (0.99, 8)]:
        assert expected_tokens(rate, gamma) == pytest.approx((1 - rate ** (gamma + 1)) / (1 - rate))


def test_the_choice_maximizes_expected_tokens_per_second_and_follows_acceptance():
    """A round costs 10 ms plus 1.2 ms a draft: at α = 0.9 the longest chain wins, and as rounds come back rejected the
    choice shortens, then the target alone wins (probed with γ = 1 so seldom that the probes' extra time is
    PROBE_SHARE of the time at most); acceptance returning brings drafting back."""
    choice = DraftLength(8)
    ms = [10.0 + 1.2 * g for g in range(9)]  # γ drafts then a verify of γ + 1 positions
    choice.round_ms = {1: ms}
    choice.kept, choice.rejected = 90.0, 10.0
    assert choice.choose(1) == max(range(9), key=lambda g: expected_tokens(0.9, g) / ms[g]) == 8
    seen = []
    for _ in range(300):
        gamma = choice.choose(1)
        seen.append(gamma)
        if gamma:
            choice.observe(gamma, [0])  # every first draft rejected
    assert choice.rate < 0.1
    every = choice.probe_every(1)
    assert every == 6 and every * 10.0 * PROBE_SHARE >= ms[1] - ms[0] - 1e-9
    last = seen[-3 * every :]
    assert last.count(0) == 3 * every - 3 and last.count(1) == 3, "the target alone, probed once every 6 rounds"
    for _ in range(200):
        gamma = choice.choose(1)
        if gamma:
            choice.observe(gamma, [gamma])  # every draft kept again
    assert choice.choose(1) == 8


def test_each_batch_size_chooses_with_the_round_times_between_those_timed():
    """Drafts that are nearly free at one row and cost more than a verify each at 16 rows: at α = 0.9 one row
    takes the longest chain and 16 rows the target alone (no γ pays for itself there); a batch size between takes
    the times linearly between, and so a length between."""
    choice = DraftLength(8)
    one, full = [10.0 + 0.5 * g for g in range(9)], [40.0 + 50.0 * g for g in range(9)]
    choice.round_ms = {1: one, 16: full}
    choice.kept, choice.rejected = 900.0, 100.0
    assert choice.ms(3, 1) == one[3] and choice.ms(3, 16) == full[3] and choice.ms(3, 40) == full[3]
    assert choice.ms(3, 6) == pytest.approx(one[3] + (full[3] - one[3]) * 5 / 15)
    assert choice.choose(1) == 8 and choice.choose(16) == 0
    middle = choice.choose(4)
    between = [(1 - 3 / 15) * a + 3 / 15 * b for a, b in zip(one, full)]
    assert middle == max(range(9), key=lambda g: expected_tokens(0.9, g) / between[g]) and 0 < middle < 8


def test_costly_drafts_are_never_chosen_when_no_length_pays_for_itself():
    """The CPU case of issue 32: a 5-token verify costs ~3.3 one-token steps and drafts a third of one. Even at an
    accepted length of 4.0 of 5, γ = 4 gives 4.0 / (3.3 + 4/3) < 1 token per step: no γ wins, the target alone
    runs except for the probes (γ = 1, one round in 46: 2 % of the time)."""
    choice = DraftLength(8)
    choice.round_ms = {1: [1.0] + [0.575 * (g + 1) + g / 3 + 0.425 for g in range(1, 9)]}
    choice.kept, choice.rejected = 0.8 * 1000, 0.2 * 1000  # α ≈ 0.8: 3.4 tokens a round at γ = 4
    assert choice.probe_every(1) == 46
    picks = [choice.choose(1) for _ in range(4 * 46)]
    assert picks.count(0) == 4 * 46 - 4 and picks.count(1) == 4


def test_drafting_replaces_the_target_alone_only_when_predicted_faster_by_the_margin():
    """At α = 0.5 a round of γ = 1 yields 1.5 tokens: priced just under (1 + DRAFT_MARGIN) · 1.5 target steps it is
    predicted faster but within the start-up timing's error, so the target runs alone (with its probes); priced just
    over the margin's reach, γ = 1 runs every round."""
    choice = DraftLength(1)
    choice.kept, choice.rejected = 500.0, 500.0
    step = 10.0
    choice.round_ms = {1: [step, 1.5 * step / (1 + DRAFT_MARGIN) * 1.001]}  # 1.5 / ms: (1 + margin) · 0.999 / step
    assert choice.expected(1) / choice.ms(1, 1) > 1 / step  # predicted faster than the target alone
    every = choice.probe_every(1)
    picks = [choice.choose(1) for _ in range(2 * every)]
    assert picks.count(1) == 2 and picks.count(0) == 2 * every - 2
    choice.round_ms = {1: [step, 1.5 * step / (1 + DRAFT_MARGIN) * 0.999]}
    assert [choice.choose(1) for _ in range(50)] == [1] * 50


def test_probes_pay_for_the_drafters_catch_up_and_stop_where_it_alone_exceeds_their_share():
    """Round times of the 1 : 3 self-draft on 2 CPU cores (a γ = 1 round costs 36 ms more than the target's 70 ms)
    and a drafter's catch-up c per round it sat out: a probe's extra time over W rounds is 36 + W·c, so the interval
    grows until that is PROBE_SHARE of W rounds, and where c alone exceeds the share no interval does it and the
    target runs alone (once IDLE_EVIDENCE drafts were read)."""
    choice = DraftLength(8)
    choice.round_ms = {1: [70.0 + 36.0 * g for g in range(9)], 16: [300.0 + 100.0 * g for g in range(9)]}
    choice.kept, choice.rejected = 10.0, 990.0  # α ≈ 0.01: no γ pays for itself
    assert choice.probe_every(1) == math.ceil(36.0 / (PROBE_SHARE * 70.0)) == 26
    choice.catch_up_ms = {1: 0.7, 16: 11.2}
    every = choice.probe_every(1)
    assert every == math.ceil(36.0 / (PROBE_SHARE * 70.0 - 0.7)) == 52
    assert (36.0 + every * 0.7) / (every * 70.0) <= PROBE_SHARE  # the probes' share, their catch-up included
    picks = [choice.choose(1) for _ in range(3 * every)]
    assert picks.count(1) == 3 and picks.count(0) == 3 * every - 3
    assert choice.catch_up(4) == pytest.approx(0.7 + (11.2 - 0.7) * 3 / 15)  # between the batch sizes timed
    choice.catch_up_ms = {1: 2.1, 16: 3.0}  # 16 rows: rounds of 300 ms, whose catch-up is within their share
    assert choice.probe_every(1) is None and choice.probe_every(16) == math.ceil(100.0 / (PROBE_SHARE * 300.0 - 3.0))
    _with_evidence(choice)
    assert set(choice.choose(1) for _ in range(1000)) == {0}


def test_a_tree_is_tried_on_its_prediction_and_then_judged_by_its_own_rounds():
    """With tree: auto a tree's yield is predicted as a chain of its depth keeping one of `topk` children a step;
    at α = 0.6 that makes the (4, 3, 8) tree the best arm. Rounds of it that keep nothing scale its prediction down
    until the best chain wins; they leave the chains' α alone."""
    tree = TreeShape(depth=4, topk=3, budget=8)
    choice = DraftLength(4, [tree])
    ms = [10.0, 11.0, 12.0, 13.0, 14.0, 15.0]  # arm 5: the tree
    choice.round_ms = {1: ms}
    choice.kept, choice.rejected = 600.0, 400.0
    assert choice.expected(5) == pytest.approx(expected_tokens(1 - 0.4**3, 4))
    assert choice.choose(1) == 5
    for _ in range(40):
        choice.observe(5, [0])
    best_chain = max(range(5), key=lambda g: expected_tokens(0.6, g) / ms[g])
    assert choice.choose(1) == best_chain and choice.rate == pytest.approx(0.6)
    assert choice.expected(5) < 1.5


def test_the_choice_kept_between_reads_is_the_one_computed_afresh():
    """`choose` keeps its plan per batch size until a drafting round is read or the times change: over random reads
    (of every arm, a tree's included), batch sizes and re-timings, each choice equals a fresh chooser's given the
    same estimates and the same probe count."""
    rng = random.Random(0)
    tree = TreeShape(depth=3, topk=2, budget=6)
    choice = DraftLength(4, [tree])

    def timed() -> dict[int, list[float]]:
        return {n: sorted(rng.uniform(1.0, 4.0) * n**0.5 for _ in range(choice.arms)) for n in (1, 16)}

    choice.round_ms, choice.catch_up_ms = timed(), {1: 0.01, 16: 0.05}
    picks = set()
    for _ in range(600):
        rows = rng.choice([1, 5, 16])
        if rng.random() < 0.05:
            choice.round_ms = timed()
        if rng.random() < 0.3:
            arm = rng.randrange(choice.arms)
            choice.observe(arm, [rng.randint(0, choice.shape(arm)[0]) for _ in range(rows)])
        fresh = DraftLength(4, [tree])
        fresh.round_ms, fresh.catch_up_ms = choice.round_ms, choice.catch_up_ms
        fresh.kept, fresh.rejected, fresh.tree_rounds, fresh.waited = (
            choice.kept,
            choice.rejected,
            list(choice.tree_rounds),
            choice.waited,
        )
        pick = choice.choose(rows)
        assert pick == fresh.choose(rows) and choice.waited == fresh.waited
        picks.add(pick)
    assert len(picks) >= 3  # the reads moved the choice between arms


def test_auto_is_refused_where_a_round_must_take_one_gamma(pair):  # noqa: F811
    draft, target = pair
    base = [{"kind": "model", "model": str(draft)}, {"kind": "rejection", "model": str(target)}]
    cases = {
        "under another level": [
            base[0],
            {**base[1], "num_draft_tokens": "auto", "temperature": 1.0},
            {"kind": "smc", "model": str(target), "temperature": 1.0},
        ],
        "with a tree": [base[0], {**base[1], "num_draft_tokens": "auto", "tree": {"depth": 3}}],
        "neither a number": [base[0], {**base[1], "num_draft_tokens": "many"}],
    }
    for levels in cases.values():
        with pytest.raises(ConfigError, match=r"levels\[1\]\.num_draft_tokens"):
            load_config({"levels": levels})
    smc = {"kind": "smc", "model": str(target), "temperature": 1.0}
    for levels in (
        [base[0], {**base[1], "tree": "many"}],
        [base[0], {**base[1], "tree": "auto", "temperature": 1.0}, smc],
    ):
        with pytest.raises(ConfigError, match=r"levels\[1\]\.tree"):
            load_config({"levels": levels})


def test_start_times_every_gamma_and_a_longer_round_costs_more(pair):  # noqa: F811
    """Each γ in 0..AUTO_MOST_DRAFTS is timed at start (γ drafts and a verify of γ + 1 positions: the longest round
    costs more than the verifier alone), with one request and with as many as the rows and the KV pools hold; the
    timing's synthetic rounds leave no trace in the acceptance estimate."""
    draft, target = pair
    decoder = _auto_stack({"kind": "model", "model": str(draft)}, target, 0.0, capacity=600)
    choice = decoder.stack.top.draft_length
    longest = 16 + TIMING_DEEPEST_ROUNDS * (AUTO_MOST_DRAFTS + 1) + decoder.stack.lookahead  # a timing request's tokens
    full = 600 // longest
    assert 8 <= full < 16 and set(choice.round_ms) == {1, 4, full}  # 1, 4, ... requests and what the KV pools hold
    assert set(choice.catch_up_ms) == set(choice.round_ms)  # and the drafter's catch-up at each
    for ms in choice.round_ms.values():
        assert len(ms) == AUTO_MOST_DRAFTS + 1 and min(ms) > 0 and ms[AUTO_MOST_DRAFTS] > ms[0]
    assert (choice.kept, choice.rejected, choice.forced) == (1.0, 1.0, None)
    result = decoder.generate([[5, 9, 13]], max_new_tokens=16, ignore_eos=True)[0]
    assert 0 <= result.stats["levels"][1]["mean_draft_tokens"] <= AUTO_MOST_DRAFTS
    assert_pools_empty(decoder)


@pytest.mark.parametrize("drafter,tree", [("model", None), ("eagle3", None), ("eagle3", "auto")])
def test_greedy_output_is_the_verifiers_whatever_shape_each_round_takes(pair, verifier_and_head, drafter, tree):  # noqa: F811
    """T = 0: rounds of γ = 0 (the verifier alone, the drafter catching up later) mixed with chains up to 8 (and,
    with tree: auto, draft trees) give transformers' greedy decode token for token, for a model drafter and an
    EAGLE3 head."""
    if drafter == "model":
        below, target = {"kind": "model", "model": str(pair[0])}, pair[1]
    else:
        below, target = {"kind": "eagle3", "model": str(verifier_and_head[1])}, verifier_and_head[0]
    decoder = _auto_stack(below, target, 0.0, tree=tree, timed=False)
    picks = PICKS + (TREE_PICKS if tree else [])
    taken = _scheduled(decoder, picks)
    prompts = [[5, 9, 13], [7] * 11, [40, 41, 42, 43, 44, 45], [3]]
    results = decoder.generate(prompts, max_new_tokens=24, ignore_eos=True)
    for prompt, result in zip(prompts, results):
        assert result.token_ids == _hf_greedy(target, prompt, 24)
    assert set(taken) == set(picks)
    assert_pools_empty(decoder)


def _eagle_rounds(
    verifier, head, picks: list[int], every_round: bool = False, tokens: int = 60
) -> tuple[list, list[int], int, int]:
    """Greedy decode of two prompts by [eagle3 head, rejection auto] with γ forced from `picks`: the drafts of every
    draft (as lists), the pairs left waiting after each round, the head's forwards and its `max_pending`.
    `every_round`: the head processes the pairs of a round without drafts at once (what it did before)."""
    decoder = _auto_stack({"kind": "eagle3", "model": str(head)}, verifier, 0.0, timed=False)
    level, eagle = decoder.stack.top, decoder.stack.levels[0]
    _scheduled(decoder, picks)
    drafts, waiting = [], []
    propose, step, accept = eagle.propose, level.step, eagle.accept

    def record_drafts(rows, k, at_most=False):
        proposal = propose(rows, k, at_most)
        drafts.append(proposal.tokens.tolist())
        return proposal

    def record_waiting(rows):
        emission = step(rows)
        waiting.append(eagle.pending_bound)
        return emission

    def accept_now(*args, **kwargs):
        accept(*args, **kwargs)
        eagle._catch_up(args[0])

    eagle.propose, level.step = record_drafts, record_waiting
    if every_round:
        eagle.accept = accept_now
    prompts = [[5, 9, 13], [7] * 11]
    results = decoder.generate(prompts, max_new_tokens=tokens, ignore_eos=True)
    for prompt, result in zip(prompts, results):
        assert result.token_ids == _hf_greedy(verifier, prompt, tokens)
    assert_pools_empty(decoder)
    return drafts, waiting, results[0].stats["levels"][0]["forwards"], eagle.max_pending


def test_an_eagle3_head_sits_out_rounds_without_drafts_and_drafts_as_if_it_had_not(verifier_and_head):  # noqa: F811
    """In a round of γ = 0 the head only stores the verifier's features and processes those pairs at its next draft:
    its drafts equal those of a twin that processes them every round (as it did before), with fewer forwards; a
    streak of γ = 0 longer than the pairs it may leave waiting (`max_pending`, within its feature window) is cut by
    a round that drafts; the greedy tokens stay the verifier's throughout."""
    verifier, head = verifier_and_head
    picks = [0, 0, 0, 2, 0, 3] + [0] * 9 + [1]
    drafts, waiting, forwards, most = _eagle_rounds(verifier, head, picks)
    twin_drafts, twin_waiting, twin_forwards, _ = _eagle_rounds(verifier, head, picks, every_round=True)
    assert drafts == twin_drafts and len(drafts) >= 8
    assert max(twin_waiting) == 0 and 9 <= max(waiting) < most
    assert forwards < twin_forwards
    _, waiting, _, most = _eagle_rounds(verifier, head, [0] * 80 + [1], tokens=80)
    assert max(waiting) == most  # reached, and a drafting round came next
    picks = [0] * most + [1, 0, 0, 2]  # a backlog as long as the window allows, then drafts
    drafts = _eagle_rounds(verifier, head, picks, tokens=80)[0]
    assert drafts and drafts == _eagle_rounds(verifier, head, picks, every_round=True, tokens=80)[0]


def _with_evidence(choice: DraftLength) -> None:
    """Let `choice` have read IDLE_EVIDENCE drafts (rounds of γ = 1), its estimate of α left as it was."""
    kept, rejected = choice.kept, choice.rejected
    for _ in range(IDLE_EVIDENCE):
        choice.observe(1, [0])
    choice.kept, choice.rejected = kept, rejected


def _read_rounds(choice: DraftLength, rate: float, rounds: int, seed: int = 0, later: float | None = None) -> list[int]:
    """`rounds` rounds of one row chosen by `choice`, the first draft kept with probability `rate` and each one after
    a kept draft with `later` (default: `rate`), until one is not; the arms taken."""
    rng, taken = random.Random(seed), []
    for _ in range(rounds):
        arm = choice.choose(1)
        taken.append(arm)
        if arm:
            kept = 0
            while kept < arm and rng.random() < (rate if kept == 0 or later is None else later):
                kept += 1
            choice.observe(arm, [kept])
    return taken


def test_the_choice_goes_idle_for_good_only_after_enough_drafts_were_read():
    """Round times of an H200 with SmolLM2 and its EAGLE3 head in bf16 (batch 1, catch-up 0.05 ms: no probe pays).
    A pair keeping 65 % of its drafts (γ = 5 predicted 1.41x the target alone) keeps drafting however its first
    rounds go; taking the idle decision at the first rounds read left it idle for good in 101 of 200 seeds and 181 of
    200 when its first rounds kept 40 %. A drafter that keeps nothing costs IDLE_EVIDENCE rounds of γ = 1, then no
    round drafts again."""
    times, catch_up = {1: [0.79, 1.18, 1.28, 1.36, 1.46, 1.48, 1.62, 1.66, 1.85]}, {1: 0.05}
    for seed in range(20):
        good = DraftLength(8)
        good.round_ms, good.catch_up_ms = times, catch_up
        for _ in range(3):  # a hard start: three rounds of γ = 3 that keep nothing
            good.observe(3, [0])
        assert min(_read_rounds(good, 0.65, 300, seed)[-100:]) >= 2 and not good.idle
    useless = DraftLength(8)
    useless.round_ms, useless.catch_up_ms = times, catch_up
    taken = _read_rounds(useless, 0.0, 300)
    first = taken.index(1)  # after the prior's first rounds (of γ = 3), each of which read one draft
    assert taken[first:IDLE_EVIDENCE] == [1] * (IDLE_EVIDENCE - first) and min(taken[:first]) > 1
    assert set(taken[IDLE_EVIDENCE:]) == {0} and useless.idle and useless.read == IDLE_EVIDENCE


def test_alphas_upper_bound_holds_the_kept_share_and_narrows_with_the_drafts_read():
    """`rate_bound` (Wilson's one-sided 95 % bound on every draft read since the timing, undiscounted): 1 before any
    read, above the share kept, closing on it as drafts are read; the decayed estimate does not move it back."""
    choice = DraftLength(8)
    assert choice.rate_bound == 1.0
    bounds = []
    for rounds in (8, 32, 128, 512):
        choice.forget()
        for i in range(rounds):
            choice.observe(3, [3 if i % 2 else 0])  # 3 kept, then 1 rejected: 3/4 of the drafts read kept
        assert (choice.read, choice.seen_kept) == (2 * rounds, 3 * rounds // 2)
        bounds.append(choice.rate_bound)
    assert all(0.75 < b < 1 for b in bounds) and bounds == sorted(bounds, reverse=True) and bounds[-1] < 0.78
    choice.kept, choice.rejected = 0.0, 50.0  # the decayed estimate's counts
    assert choice.rate_bound == bounds[-1]


def test_the_evidence_for_idling_is_read_from_the_chain_that_would_pay():
    """Round times of an H200 with SmolLM2 and its EAGLE3 head in bf16 at T = 0 (catch-up 0.02 ms: no probe pays). A
    head keeping its first draft 55 % of the time and a draft after a kept one 80 % yields 2.37 tokens a round of
    γ = 3, 1.10x the target alone. Rounds of γ = 1 read only first drafts, α = 0.55, where no chain is predicted to
    pay, so evidence read from them takes the choice idle; rounds of the chain predicted fastest read the later
    drafts too, and the choice keeps drafting. (On the H200 the head read α = 0.59-0.63 from rounds of γ = 1 and went
    idle at 0.89-0.91x the target alone, while γ = 3 kept 2.49 tokens a round at 1.00-1.04x.)"""
    times, catch_up = {1: [0.64, 1.19, 1.29, 1.38, 1.48, 1.52, 1.62, 1.71, 1.82]}, {1: 0.02}
    first_drafts = DraftLength(8)
    first_drafts.round_ms, first_drafts.catch_up_ms = times, catch_up
    for i in range(IDLE_EVIDENCE * 5):
        first_drafts.observe(1, [int(i % 20 < 11)])  # 11 of every 20 kept
    assert first_drafts.never_drafts  # what rounds of γ = 1 alone decide
    for seed in range(20):
        choice = DraftLength(8)
        choice.round_ms, choice.catch_up_ms = times, catch_up
        taken = _read_rounds(choice, 0.55, 300, seed, later=0.8)
        assert not choice.idle and min(taken[-100:]) >= 2, (seed, taken)


def test_where_no_batch_size_drafts_or_probes_the_choice_goes_idle_until_the_times_change():
    """Round times of an H200 with SmolLM2 and its EAGLE3 head (fp32, T = 1): at α = 0.5 no γ pays, and the drafters'
    catch-up alone exceeds the probes' share at 1 and 16 rows, so no round will draft or be read (`never_drafts`):
    the choice goes idle, γ = 0 for good, and a drafting round read afterwards (launched before) changes nothing.
    New round times end it; a batch size where probes pay or a better acceptance keep it from starting."""
    choice = DraftLength(8)
    times = {1: list(IDLE_MS)}
    times[16] = [3 * t for t in times[1]]
    choice.round_ms, choice.catch_up_ms = times, {1: 0.03, 16: 0.09}  # > PROBE_SHARE of 0.75 and of 2.25 ms
    _with_evidence(choice)
    assert choice.never_drafts and not choice.idle
    assert set(choice.choose(n) for n in (1, 5, 16) for _ in range(500)) == {0} and choice.idle
    choice.observe(3, [3] * 50)  # α ≈ 0.9 now: γ = 3 would yield 3.44 tokens in 2.14 ms
    assert not choice.never_drafts and choice.choose(1) == 0
    choice.round_ms = dict(times)  # times change (a following rank's copy of the timing's): the plans follow α
    assert not choice.idle and choice.choose(1) > 0
    choice.forget()
    _with_evidence(choice)
    choice.catch_up_ms = {1: 0.03, 16: 0.01}  # probes pay at 16 rows: a probe there may change every plan
    assert not choice.never_drafts and choice.choose(1) == 0 and not choice.idle
    choice.catch_up_ms = {1: 0.03, 16: 0.09}
    choice.forced = 0  # a timing or a warmup
    assert not choice.never_drafts and choice.choose(1) == 0 and not choice.idle


def _spies(owner, *names: str) -> dict[str, mock.Mock]:
    """`owner`'s methods `names`, each wrapped from now on by a mock that counts its calls."""
    spies = {name: mock.Mock(wraps=getattr(owner, name)) for name in names}
    for name, spy in spies.items():
        setattr(owner, name, spy)
    return spies


def _calls(spies: dict[str, mock.Mock]) -> dict[str, int]:
    return {name: spy.call_count for name, spy in spies.items()}


def _never_drafting(choice: DraftLength) -> None:
    """Give `choice` round times (those of the test above) and the reads that make it never draft."""
    choice.round_ms = {1: list(IDLE_MS)}
    choice.catch_up_ms = {1: 0.03}
    _with_evidence(choice)


def _idle_stack(drafter: dict, target, temperature: float) -> HierarchicalDecoder:
    """An auto stack that never drafts."""
    decoder = _auto_stack(drafter, target, temperature, rows=4, timed=False)
    _never_drafting(decoder.stack.top.draft_length)
    return decoder


def test_a_choice_that_never_drafts_leaves_the_drafter_out_and_samples_as_if_told(pair, verifier_and_head):  # noqa: F811
    """Where no round will draft again the drafter is told nothing: a `model` drafter runs no forward past its
    prefill and an EAGLE3 head stores no features and leaves no backlog (so its window forces no drafting round),
    while the tokens are those of rounds of γ = 0 that tell it everything: at T = 1 the same seeded draws as a twin
    whose drafter follows, at T = 0 the verifier's greedy tokens, and every block goes back at the end."""
    draft, target = pair
    prompts = [[5, 9, 13], [7] * 11, [2, 4]]
    params = [SamplingParams(seed=s, max_tokens=40, ignore_eos=True) for s in (3, 4, 5)]
    idle = _idle_stack({"kind": "model", "model": str(draft)}, target, 1.0)
    told = _auto_stack({"kind": "model", "model": str(draft)}, target, 1.0, rows=4, timed=False)
    _scheduled(told, [0])
    calls = _spies(idle.stack.levels[0], "accept", "propose", "prefill")
    got = [r.token_ids for r in idle.generate(prompts, params=params)]
    assert got == [r.token_ids for r in told.generate(prompts, params=params)]
    assert _calls(calls) == {"accept": 0, "propose": 0, "prefill": 1} and idle.stack.top.idle_drafter
    assert told.stack.levels[0].state.pending_bound >= 39  # the twin's drafter was told every token
    assert_pools_empty(idle)

    verifier, head = verifier_and_head
    idle = _idle_stack({"kind": "eagle3", "model": str(head)}, verifier, 0.0)
    eagle = idle.stack.levels[0]
    calls = _spies(eagle, "accept", "propose", "prefill", "_store")
    n = eagle.max_pending + 20  # past the window's backlog limit
    for prompt in prompts:
        (result,) = idle.generate([prompt], max_new_tokens=n, ignore_eos=True)
        assert result.token_ids == _hf_greedy(verifier, prompt, n)
    assert _calls(calls) == {"accept": 0, "propose": 0, "prefill": 3, "_store": 3}  # the prefills' features only
    assert eagle.pending_bound == 0 and idle.stack.top.drafted == 0
    assert_pools_empty(idle)


def test_an_eagle3_heads_backlog_ends_with_its_requests(verifier_and_head):  # noqa: F811
    """Pairs left waiting by rounds of γ = 0 belong to the rows that left them: once those have ended (the driver
    bounds every length to 0 before it admits the next rows) the backlog is 0, so the next requests' rounds of γ = 0
    start from none and meet no drafting round forced by `max_pending` (runs of a little under it draw no draft)."""
    verifier, head = verifier_and_head
    decoder = _auto_stack({"kind": "eagle3", "model": str(head)}, verifier, 0.0, timed=False)
    eagle = decoder.stack.levels[0]
    _scheduled(decoder, [0])
    drafts = []
    propose = eagle.propose
    eagle.propose = lambda rows, k, at_most=False: drafts.append(k) or propose(rows, k, at_most)
    prompt, n = [5, 9, 13], eagle.max_pending - 2
    for _ in range(3):
        (result,) = decoder.generate([prompt], max_new_tokens=n, ignore_eos=True)
        assert result.token_ids == _hf_greedy(verifier, prompt, n)
    assert drafts == []
    assert_pools_empty(decoder)


@pytest.mark.parametrize("drafter,tree", [("model", None), ("eagle3", None), ("model", "auto")])
def test_lossless_in_distribution_whatever_shape_each_round_takes(small_vocab_pair, small_vocab, drafter, tree):  # noqa: F811
    """T = 1, 20 000 samples of 3 tokens with γ changing every round (0..8; with tree: auto, the two smaller draft
    trees verified by draft_aware among them; every tree shape's exactness: test_tree_stack.py): χ² against the
    verifier's exact law, and the drafter's own law is told apart (the test has power)."""
    if drafter == "model":
        (draft, target), below = small_vocab_pair, {"kind": "model", "model": str(small_vocab_pair[0])}
        below["temperature"] = 0.7
    else:
        target, head = small_vocab
        draft, below = None, {"kind": "eagle3", "model": str(head), "temperature": 1.0}
    decoder = _auto_stack(
        below, target, 1.0, rows=2500, tree=tree, rule="draft_aware" if tree else "target_only", timed=False
    )
    picks = PICKS + (SMALL_TREE_PICKS if tree else [])
    random.Random(5).shuffle(picks)
    _scheduled(decoder, picks)
    prompt, n_samples = [1, 4, 2], 20_000
    results = decoder.generate([prompt] * n_samples, max_new_tokens=3, ignore_eos=True, seed=17)
    samples = [tuple(r.token_ids) for r in results]
    assert _chi2_pvalue(samples, _exact_first_tokens(target, prompt, 3)) > 1e-3
    if draft is not None:
        assert _chi2_pvalue(samples, _exact_first_tokens(draft, prompt, 3)) < 1e-6
    assert results[0].stats["levels"][1]["mean_accepted_length"] > 1.0, "drafts should be kept in some rounds"
    assert_pools_empty(decoder)


def test_start_timing_captures_each_gammas_round_so_the_rounds_timed_are_replays(pair, monkeypatch):  # noqa: F811
    """On CUDA a round is one graph per shape (γ among its keys): the timing captures every γ's round at its first
    run (units and captures emulated here), so what it times is what decoding will replay; capturing is then as
    before. A capture costs more than many rounds (here 0.4 s): no timing that includes one is kept (on an H100 the
    one-token run of a later repeat captured, and the round times came out negative)."""
    from test_round_graphs import _emulated_capture

    from hsmc.engine.graphs import Graphs

    def slow_capture(*args):
        time.sleep(0.4)
        return _emulated_capture(*args)

    monkeypatch.setattr(Graphs, "_capture", slow_capture)
    decoder = _auto_stack({"kind": "model", "model": str(pair[0])}, pair[1], 0.0, timed=False)
    level, scope = decoder.stack.top, decoder.stack.scope
    level.rounds = Graphs(level._kept, scope, level.graph_parts().host, level.state.timer.whole)
    was = scope.capturing
    decoder._time_rounds(level)
    gamma = [f.name for f in level.rounds.host if f.role == "key"].index("gamma")
    assert {key[0][2][gamma] for key in level.rounds.captured} == set(range(AUTO_MOST_DRAFTS + 1))
    assert level.rounds.missed == 0 and scope.capturing == was
    times = level.draft_length.round_ms
    assert all(0 < ms < 1000 for arms in times.values() for ms in arms), times


def test_rounds_without_drafts_recur_as_one_graph_while_the_drafter_falls_behind(pair, monkeypatch):  # noqa: F811
    """A `model` drafter does not run in a round of γ = 0, so the tokens waiting for its next forward grow by one a
    round. Those rounds must still be one shape that is captured and replayed (units and captures emulated here; on
    an H100 each was a new shape run eagerly, and a 1 : 3 self-draft under auto decoded at 0.09-0.53x its target
    alone), whatever the size of the draft before them (its rollback bound: on an H200 rounds of γ = 0 after a draft
    of 1 missed the graphs a warmup captured after drafts of 8). A replay runs with the host ints of its capture, as
    a CUDA graph does. The drafts between the streaks catch the drafter up, and the greedy tokens stay the target's."""
    from hsmc.engine.graphs import CAPTURE_AFTER, Graphs

    target = pair[1]
    decoder = _graphed_auto_stack(pair, monkeypatch)
    _bake_host_ints(monkeypatch, Graphs)
    level = decoder.stack.top
    taken = _scheduled(decoder, [0] * 19 + [3] + [0] * 19 + [1] + [0] * 19 + [2])
    prompt = [5, 9, 13]
    (result,) = decoder.generate([prompt], max_new_tokens=90, ignore_eos=True)
    assert result.token_ids == _hf_greedy(str(target), prompt, 90)
    bare = taken.count(0)
    assert set(taken) == {0, 1, 2, 3} and bare >= 50
    assert len(level.bare_rounds.captured) == 1  # one shape: after no draft, and after drafts of 3, 1 and 2
    assert level.bare_rounds.replays >= bare - CAPTURE_AFTER, (level.bare_rounds.replays, bare)
    assert_pools_empty(decoder)


def _bake_host_ints(monkeypatch, graphs) -> None:
    """Emulated replays run with the host ints their capture saw (a CUDA graph bakes in what the code read then);
    `Graphs` restores the ints the replay should leave afterwards, as on CUDA."""
    capture = graphs._capture

    def baking(self, key, static, before, after, context, options):
        outputs = capture(self, key, static, before, after, context, options)
        replayer = self.captured[key].graph
        replay = replayer.replay

        def replay_as_captured() -> None:
            self.restore(before)
            replay()

        replayer.replay = replay_as_captured
        return outputs

    monkeypatch.setattr(graphs, "_capture", baking)


def test_rounds_that_leave_the_drafter_out_recur_as_one_graph(verifier_and_head, monkeypatch):  # noqa: F811
    """Rounds of a choice that never drafts are their own graph's shape (the drafter left out is a key), captured
    once it recurs and replayed (units and captures emulated), the greedy tokens the verifier's."""
    from hsmc.engine.graphs import CAPTURE_AFTER

    decoder = _graphed_auto_stack(verifier_and_head, monkeypatch, drafter="eagle3")
    level = decoder.stack.top
    _never_drafting(level.draft_length)
    prompt = [5, 9, 13]
    (result,) = decoder.generate([prompt], max_new_tokens=90, ignore_eos=True)
    assert result.token_ids == _hf_greedy(verifier_and_head[0], prompt, 90)
    assert level.idle_drafter and level.rounds.replays == 0
    assert level.bare_rounds.replays >= 89 - CAPTURE_AFTER, level.bare_rounds.replays
    assert_pools_empty(decoder)


def test_after_warmup_a_choice_gone_idle_replays_its_rounds(verifier_and_head, monkeypatch):  # noqa: F811
    """Rounds of a choice gone idle leave the drafter out, a key of their own graph: `warmup()` captures them at
    every batch size (units and captures emulated as on CUDA), so a serving stack that goes idle replays them rather
    than running each round eagerly (0.39x the target alone on an H200 before), the greedy tokens the verifier's."""
    decoder = _graphed_auto_stack(verifier_and_head, monkeypatch, drafter="eagle3", rows=2)
    level = decoder.stack.top
    decoder.warmup(progress=False)
    _never_drafting(level.draft_length)
    prompts = [[5, 9, 13], [7] * 11]
    results = decoder.generate(prompts, max_new_tokens=40, ignore_eos=True)
    assert [r.token_ids for r in results] == [_hf_greedy(verifier_and_head[0], p, 40) for p in prompts]
    assert level.idle_drafter and level.rounds.replays == 0
    assert level.bare_rounds.missed == 0 and level.bare_rounds.replays >= 39, level.bare_rounds.missed
    assert_pools_empty(decoder)


def test_an_eagle3_heads_probes_after_streaks_recur_as_one_graph(verifier_and_head, monkeypatch):  # noqa: F811
    """An EAGLE3 head's pairs left by rounds of γ = 0 are a key of the next drafting round's graph: its bound is
    taken to `max_pending` before such a round, so every probe after a streak (of any length) is one shape,
    captured once it recurs and replayed (units and captures emulated), and the greedy tokens stay the verifier's."""
    from hsmc.engine.graphs import CAPTURE_AFTER

    decoder = _graphed_auto_stack(verifier_and_head, monkeypatch, drafter="eagle3")
    level = decoder.stack.top
    taken = _scheduled(decoder, [0] * 2 + [1] + [0] * 5 + [1] + [0] * 9 + [1])
    prompt = [5, 9, 13]
    (result,) = decoder.generate([prompt], max_new_tokens=150, ignore_eos=True)
    assert result.token_ids == _hf_greedy(verifier_and_head[0], prompt, 150)
    probes = taken.count(1)
    assert probes >= 12 and level.rounds.replays >= probes - CAPTURE_AFTER - 1, (level.rounds.replays, probes)
    assert level.bare_rounds.replays > 0
    assert_pools_empty(decoder)


def test_probes_after_streaks_of_different_lengths_recur_as_one_graph(pair, monkeypatch):  # noqa: F811
    """After k rounds of γ = 0 a `model` drafter has k + 1 tokens waiting, and that count is a key of the probe's
    round graph: streaks of 4, 5 and 6 rounds would make three shapes, none recurring enough to be captured (on an
    H200 each probe then ran eagerly, its catch-up forward alone 6-16 ms against ~1 ms a graphed round). The bound
    is rounded up to a power of two before a round with drafts, so the probes share one shape, are captured and
    replay (units and captures emulated), and the greedy tokens stay the target's."""
    from hsmc.engine.graphs import CAPTURE_AFTER

    target = pair[1]
    decoder = _graphed_auto_stack(pair, monkeypatch)
    level = decoder.stack.top
    taken = _scheduled(decoder, [0] * 4 + [1] + [0] * 5 + [1] + [0] * 6 + [1])  # 5-7 tokens waiting: a bound of 8
    prompt = [5, 9, 13]
    (result,) = decoder.generate([prompt], max_new_tokens=150, ignore_eos=True)
    assert result.token_ids == _hf_greedy(str(target), prompt, 150)
    probes = taken.count(1)
    # captured at its CAPTURE_AFTER-th run, replayed from the next (0 replays without the rounding)
    assert probes >= 12 and level.rounds.replays >= probes - CAPTURE_AFTER - 1, (level.rounds.replays, probes)
    assert_pools_empty(decoder)


def test_warmup_captures_every_draft_shape_at_every_batch_size(pair, monkeypatch):  # noqa: F811
    """`hsmc serve` warms up before its first request, and under auto a round's graph depends on the shape chosen
    (γ, or which tree) as well as the batch size: the warmup captures a round of every shape at every batch size
    (units and captures emulated as on CUDA), so a request that switches shape at any size finds a graph, and the
    choice is free again afterwards."""
    target = pair[1]
    decoder = _graphed_auto_stack(pair, monkeypatch, rows=2, tree="auto")
    level, scope = decoder.stack.top, decoder.stack.scope
    host = level.graph_parts().host
    decoder.warmup(progress=False)
    choice = level.draft_length
    assert scope.capturing == "none" and choice.forced is None
    names = [f.name for f in host if f.role == "key"]
    gamma, budget = names.index("gamma"), names.index("tree_budget")
    captured = {(key[0][0][0][0][0], key[0][2][gamma], key[0][2][budget]) for key in level.rounds.captured}
    captured |= {(key[0][0][0][0][0], 0, 0) for key in level.bare_rounds.captured}
    shapes = {(0 if tree is None else tree.depth, 0 if tree is None else tree.budget)
              for tree in [None, *choice.trees]} | {(g, 0) for g in range(1, choice.most + 1)}  # fmt: skip
    assert captured == {(rows, g, b) for rows in (1, 2) for g, b in shapes}
    prompts = [[5, 9, 13], [7] * 11]
    taken = _scheduled(decoder, [11] * 3 + [4] * 3)  # a tree, then a chain, in one request
    results = decoder.generate(prompts, max_new_tokens=24, ignore_eos=True)
    assert [r.token_ids for r in results] == [_hf_greedy(str(target), p, 24) for p in prompts]
    assert {11, 4} <= set(taken) and level.rounds.replays > 0
    assert_pools_empty(decoder)


def test_after_warmup_rounds_that_switch_gamma_replay_the_warmups_graphs(pair, monkeypatch):  # noqa: F811
    """A round graph is keyed by the shape it drafts, not by the size of the draft before it (which the round sets
    before its accept reads it): after `warmup()`, rounds switching γ between 4 and 2 every 3 rounds, the first round
    of a request among them, all replay (units and captures emulated as on CUDA; keyed by the last draft's size, 14
    of 41 such rounds ran eagerly), and the greedy tokens stay the target's."""
    decoder = _graphed_auto_stack(pair, monkeypatch, rows=2)
    level = decoder.stack.top
    decoder.warmup(progress=False)
    taken = _scheduled(decoder, [4] * 3 + [2] * 3)
    prompts = [[5, 9, 13], [7] * 11]
    results = decoder.generate(prompts, max_new_tokens=40, ignore_eos=True)
    assert [r.token_ids for r in results] == [_hf_greedy(str(pair[1]), p, 40) for p in prompts]
    assert {4, 2} == set(taken) and level.rounds.missed == 0 and level.rounds.replays == len(taken)
    assert_pools_empty(decoder)


def test_the_cost_model_prices_a_chosen_shape_at_the_drafts_its_rounds_took():
    """`hsmc bench` prices a rejection level's round at its drafter's forwards: γ for a chain, the depth for a tree,
    and for `auto` the mean its rounds took (not the longest arm)."""
    from types import SimpleNamespace

    from hsmc.bench import level_costs
    from hsmc.config import LevelConfig, TreeConfig

    configs = [
        LevelConfig(kind="model", model="d"),
        LevelConfig(kind="rejection", model="t", num_draft_tokens=3),
        LevelConfig(kind="rejection", model="t", tree=TreeConfig(depth=5, topk=2, budget=8)),
        LevelConfig(kind="rejection", model="t", num_draft_tokens="auto", tree="auto"),
    ]
    stats = [
        {"forward_ms": 1.0},
        {"forward_ms": 2.0},
        {"forward_ms": 2.0},
        {"forward_ms": 2.0, "mean_draft_tokens": 1.5},
    ]
    costs = level_costs(SimpleNamespace(stack=SimpleNamespace(configs=configs)), stats)
    assert [c.gamma for c in costs[1:]] == [3, 5, 1.5]
