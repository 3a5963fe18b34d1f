"""SMC tensor functions against plain-Python references, plus their defining invariants."""

from __future__ import annotations

import math
import random

import pytest
import torch
from scipy.stats import chisquare

from hsmc.smc.resampling import multinomial_ancestors, resampling_plan, select_particle, systematic_ancestors
from hsmc.smc.weights import effective_sample_size, log_normalizer, weight_increments


def _logsumexp(xs: list[float]) -> float:
    m = max(xs)
    return m + math.log(sum(math.exp(x - m) for x in xs))


def _log_softmax(xs: list[float]) -> list[float]:
    z = _logsumexp(xs)
    return [x - z for x in xs]


def _reference_delta(logits, drafts, logq, kept, alpha, temp, floors) -> float:
    """DESIGN.md §3, written out one particle at a time: the first `kept` of [d_1..d_K, bonus] count; log p' is
    the tempered law over the logits at or above the position's floor (−inf below)."""

    def log_p(row: list[float], floor: float) -> list[float]:
        kept_logits = [x / temp for x in row if x >= floor]
        z = _logsumexp(kept_logits)
        return [x / temp - z if x >= floor else -math.inf for x in row]

    k = len(drafts)
    total = 0.0
    for j in range(min(kept, k)):
        total += alpha * log_p(logits[j], floors[j])[drafts[j]] - logq[j]
    if kept <= k:
        return total
    last = [x for x in log_p(logits[k], floors[k]) if x > -math.inf]
    return total + _logsumexp([alpha * x for x in last])


def _scale(temp: float, n: int) -> torch.Tensor:
    return torch.full((n,), 1 / temp, dtype=torch.float64)


@pytest.mark.parametrize("alpha,temp,cut", [(1.0, 1.0, False), (2.0, 0.7, False), (0.5, 1.3, False), (2.0, 0.7, True)])
def test_weight_increments_match_reference(alpha, temp, cut):
    gen = torch.Generator().manual_seed(0)
    n, k, v = 7, 4, 6
    logits = torch.randn(n, k + 1, v, generator=gen) * 2
    drafts = torch.randint(0, v, (n, k), generator=gen)
    logq = -torch.rand(n, k, generator=gen) * 3
    kept = torch.tensor([5, 1, 4, 5, 2, 3, 5])  # the output ends at the 1st .. 4th draft, or runs on
    # a cut keeps each position's 4 largest logits (a top-k / top-p floor): some drafts fall off it
    floors = logits.sort(-1, descending=True).values[..., 3] if cut else torch.full((n, k + 1), -math.inf)
    got = weight_increments(logits, drafts, logq, kept, alpha, _scale(temp, n), floors)
    assert got.dtype == torch.float64
    for i in range(n):
        ref = _reference_delta(
            logits[i].double().tolist(), drafts[i].tolist(), logq[i].double().tolist(), int(kept[i]), alpha, temp,
            floors[i].tolist(),
        )  # fmt: skip
        if ref == -math.inf:
            assert got[i].item() == -math.inf, f"particle {i}"
        else:
            assert got[i].item() == pytest.approx(ref, abs=1e-9), f"particle {i}"
    if cut:
        assert (got == -math.inf).any() and (got > -math.inf).any()


def test_log_normalizer_is_the_power_draws_weight():
    """Drawing x from p'(x)^α normalized instead of p'(x)^α leaves exactly the weight Σ_x p'(x)^α, with or
    without a cut."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 7, generator=gen) * 2
    none = torch.full((3,), -math.inf)
    for alpha, temp in [(1.0, 0.9), (2.0, 0.7), (0.5, 1.3)]:
        p = torch.softmax(logits.double() / temp, -1)
        got = log_normalizer(logits, alpha, _scale(temp, 3), none)
        assert torch.allclose(got, (p**alpha).sum(-1).log(), atol=1e-12)
        floor = logits.sort(-1, descending=True).values[:, 2]  # the 3 largest
        cut = torch.where(logits >= floor[:, None], logits.double() / temp, -math.inf).softmax(-1)
        got = log_normalizer(logits, alpha, _scale(temp, 3), floor)
        assert torch.allclose(got, (cut**alpha).sum(-1).log(), atol=1e-12)
    assert log_normalizer(logits, 1.0, _scale(0.8, 3), none).abs().max() < 1e-12


def test_proposal_equal_to_target_with_alpha_one_gives_zero_weights():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 4, 9, generator=gen)
    drafts = torch.randint(4, 9, (5, 3), generator=gen)
    logq = torch.log_softmax(logits[:, :3].double() / 0.8, -1).gather(-1, drafts[..., None]).squeeze(-1)
    none = torch.full((5, 4), -math.inf)
    delta = weight_increments(logits, drafts, logq, torch.tensor([4, 4, 1, 2, 3]), 1.0, _scale(0.8, 5), none)
    assert delta.abs().max() < 1e-12


def test_ess_matches_reference_and_bounds():
    logw = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, -1e9, -1e9, -1e9], [0.3, -0.2, 1.1, 0.0]])
    ess = effective_sample_size(logw)
    w = [math.exp(x) for x in logw[2].tolist()]
    ref = sum(w) ** 2 / sum(x * x for x in w)
    assert ess[0].item() == pytest.approx(4.0) and ess[1].item() == pytest.approx(1.0)
    assert ess[2].item() == pytest.approx(ref)


def _reference_inverse_cdf(weights: list[float], points: list[float]) -> list[int]:
    total = sum(weights)
    out = []
    for p in points:
        acc, chosen = 0.0, len(weights) - 1
        for i, w in enumerate(weights):
            acc += w / total
            if p < acc:
                chosen = i
                break
        out.append(chosen)
    return out


def test_systematic_and_multinomial_match_reference():
    rng = random.Random(0)
    for _ in range(50):
        n = rng.randint(1, 9)
        logw = torch.tensor([[rng.gauss(0, 2) for _ in range(n)]], dtype=torch.float64)
        weights = torch.softmax(logw[0], -1).tolist()
        u = rng.random()
        sys_got = systematic_ancestors(logw, torch.tensor([u]))[0].tolist()
        assert sys_got == _reference_inverse_cdf(weights, [(u + i) / n for i in range(n)])
        us = [rng.random() for _ in range(n)]
        assert multinomial_ancestors(logw, torch.tensor([us]))[0].tolist() == _reference_inverse_cdf(weights, us)


def test_systematic_counts_are_floor_or_ceil_of_expected():
    gen = torch.Generator().manual_seed(2)
    logw = torch.randn(200, 8, generator=gen, dtype=torch.float64) * 1.5
    ancestors = systematic_ancestors(logw, torch.rand(200, generator=gen, dtype=torch.float64))
    counts = torch.zeros(200, 8, dtype=torch.float64).scatter_add_(
        1, ancestors, torch.ones(200, 8, dtype=torch.float64)
    )
    expected = 8 * torch.softmax(logw, -1)
    assert ((counts >= expected.floor() - 1e-9) & (counts <= expected.ceil() + 1e-9)).all()
    assert torch.equal(counts.sum(-1), torch.full((200,), 8.0))


def test_selection_argmax_and_sample_distribution():
    logw = torch.tensor([[0.5, 1.5, -0.3, 0.0]], dtype=torch.float64)
    assert select_particle(logw, "argmax").tolist() == [1]
    n = 100_000
    gen = torch.Generator().manual_seed(3)
    gumbel = -torch.log(-torch.log(torch.rand((n, 4), generator=gen)))
    picks = select_particle(logw.expand(n, -1), "sample", gumbel)
    expected = torch.softmax(logw[0], -1) * n
    assert chisquare(torch.bincount(picks, minlength=4).double().numpy(), expected.numpy()).pvalue > 1e-3
    with pytest.raises(ValueError, match="selection must be"):
        select_particle(logw, "best")


def test_resampling_plan_resamples_exactly_the_live_groups_below_the_threshold():
    """Groups with ESS < τ·N that are live get systematic ancestors; the others (even ESS, or finished) keep
    identity ancestors, so one fork applies the plan to every group."""
    from hsmc.smc.resampling import resampling_plan

    logw = torch.tensor([[0.0, 0.0, 0.0, 0.0], [5.0, 0.0, 0.0, -3.0], [5.0, 0.0, 0.0, -3.0]], dtype=torch.float64)
    live = torch.tensor([True, True, False])
    u = torch.tensor([0.3, 0.3, 0.3], dtype=torch.float64)
    ancestors, resample, ess = resampling_plan(logw, live, u, 0.5, "systematic")
    assert resample.tolist() == [False, True, False]
    assert torch.allclose(ess, effective_sample_size(logw))
    assert ancestors[0].tolist() == ancestors[2].tolist() == [0, 1, 2, 3]
    assert ancestors[1].tolist() == systematic_ancestors(logw[1:2], u[1:2])[0].tolist()


def test_groups_of_fewer_particles_resample_as_if_alone():
    """Requests with different N in one batch: a group of c < N particles fills the first c columns, the rest
    log-weight -inf. Its ancestors equal those of the c particles resampled alone (systematic and multinomial,
    also at weights whose cdf rounds below 1), padding keeps its own index, and the ESS threshold is τ·c."""
    from hsmc.smc.resampling import resampling_plan

    gen = torch.Generator().manual_seed(3)
    counts = torch.tensor([5, 2, 3, 1, 4])
    logw = torch.randn(5, 5, generator=gen, dtype=torch.float64) * 3
    logw[2, :3] = torch.tensor([0.0, -40.0, -40.0], dtype=torch.float64)  # all weight on the first particle
    padded = torch.where(torch.arange(5)[None, :] < counts[:, None], logw, float("-inf"))
    u = torch.rand(5, generator=gen, dtype=torch.float64)
    us = torch.rand(5, 5, generator=gen, dtype=torch.float64)
    sys_got = systematic_ancestors(padded, u, counts)
    mult_got = multinomial_ancestors(padded, us, counts)
    for g, c in enumerate(counts.tolist()):
        assert sys_got[g, :c].tolist() == systematic_ancestors(logw[g : g + 1, :c], u[g : g + 1])[0].tolist()
        assert mult_got[g, :c].tolist() == multinomial_ancestors(logw[g : g + 1, :c], us[g : g + 1, :c])[0].tolist()
        assert sys_got[g, c:].tolist() == mult_got[g, c:].tolist() == list(range(c, 5))
    live = torch.ones(5, dtype=torch.bool)
    _, resample, ess = resampling_plan(padded, live, u, 0.5, "systematic", counts)
    alone = torch.stack([effective_sample_size(logw[g, :c]) for g, c in enumerate(counts.tolist())])
    assert torch.allclose(ess, alone)
    assert resample.tolist() == (alone < 0.5 * counts).tolist()


def test_output_ends_matches_stop_criteria():
    """The device test of the ends equals `StopCriteria.append` (no stop strings) on random blocks, per row: its
    own max_tokens, and stop tokens only where the row does not ignore EOS."""
    from hsmc.smc.ends import output_ends
    from hsmc.stopping import StopCriteria

    rng = random.Random(0)
    stop_ids = {2, 5}
    eos_criteria, ignoring = StopCriteria(frozenset(stop_ids)), StopCriteria(frozenset())
    rows = 96
    max_new = [rng.choice((1, 3, 7)) for _ in range(rows)]
    eos = [rng.random() < 0.7 for _ in range(rows)]
    generated = [rng.randint(0, m - 1) for m in max_new]
    blocks = [[rng.randint(0, 7) for _ in range(4)] for _ in range(rows)]
    kept, ends = output_ends(
        torch.tensor(blocks), torch.tensor(generated), torch.tensor(sorted(stop_ids)), torch.tensor(max_new),
        torch.tensor(eos),
    )  # fmt: skip
    for i, (before, block) in enumerate(zip(generated, blocks)):
        tokens = [9] * before
        reason = (eos_criteria if eos[i] else ignoring).append(tokens, block, max_new[i])
        assert kept[i].item() == len(tokens) - before and ends[i].item() == (reason is not None)


def test_a_group_whose_weights_are_all_zero_restarts_from_uniform_ancestors():
    """Every particle off the target's support (a cut law): ESS 0, so a live group resamples, uniformly."""
    logw = torch.tensor([[float("-inf")] * 4, [0.0, 1.0, float("-inf"), float("-inf")]], dtype=torch.float64)
    counts = torch.tensor([4, 2])
    ancestors, resample, ess = resampling_plan(logw, torch.tensor([True, True]), torch.tensor([0.3, 0.3]), 0.5,
                                               "systematic", counts)  # fmt: skip
    assert ess[0].item() == 0.0 and bool(resample[0])
    assert ancestors[0].tolist() == [0, 1, 2, 3]  # points (0.3 + i) / 4 on a uniform cdf
    assert ancestors[1].tolist()[2:] == [2, 3]  # padding keeps its own index
