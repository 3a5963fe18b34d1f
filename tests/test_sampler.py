"""The sampler's law: draws follow softmax(l/T) cut to top-k then top-p (chi-square against the exact law, with power
against a wrong one); the log-probabilities are the cut law's; T = 0 is the argmax; a row's draw depends on its key
only; the host facts of `RowLaws` follow what is assigned."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare

from hsmc.engine.sampler import RowLaws
from hsmc.ops.counter_hash import combine

LOGITS = torch.tensor([2.0, 0.5, -1.0, 1.2, 0.0, -3.0, 1.9, 0.3])


def law(rows: int, temperature: float, top_k: int = 0, top_p: float = 1.0):
    laws = RowLaws(temperature, rows, torch.device("cpu"))
    laws.assign(list(range(rows)), [(temperature, top_k, top_p)] * rows)
    return laws.at(torch.arange(rows))


def exact(logits: list[float], temperature: float, top_k: int = 0, top_p: float = 1.0) -> list[float]:
    """The cut law in plain Python: softmax(l/T), the top_k most likely, then the fewest whose mass reaches top_p."""
    order = sorted(range(len(logits)), key=lambda i: -logits[i])
    kept = order[: top_k or len(order)]
    weights = {i: math.exp(logits[i] / temperature) for i in kept}
    total = sum(weights.values())
    mass, chosen = 0.0, []
    for i in kept:
        if mass >= top_p:
            break
        chosen.append(i)
        mass += weights[i] / total
    z = sum(weights[i] for i in chosen)
    return [weights[i] / z if i in chosen else 0.0 for i in range(len(logits))]


def draws(n: int, temperature: float, top_k: int = 0, top_p: float = 1.0, seed: int = 0):
    keys = combine(torch.tensor(seed), torch.arange(n))
    return law(n, temperature, top_k, top_p).sample(LOGITS.expand(n, -1), keys)


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 0, 1.0), (0.6, 0, 1.0), (0.8, 5, 1.0),
                                                             (0.8, 0, 0.7), (0.8, 4, 0.9), (1.7, 6, 0.5)])  # fmt: skip
def test_draws_follow_the_cut_tempered_law(temperature, top_k, top_p):
    n = 100_000
    tokens, logprobs = draws(n, temperature, top_k, top_p)
    probs = exact(LOGITS.tolist(), temperature, top_k, top_p)
    observed = torch.bincount(tokens, minlength=len(LOGITS)).double()
    support = [i for i, p in enumerate(probs) if p > 0]
    assert all(observed[i] == 0 for i, p in enumerate(probs) if p == 0), "a token outside the cut was drawn"
    result = chisquare(observed[support].numpy(), [probs[i] * n for i in support])
    assert result.pvalue > 1e-3, f"chi2={result.statistic:.1f} p={result.pvalue:.2e}"
    assert torch.allclose(logprobs, torch.tensor([math.log(probs[t]) for t in tokens.tolist()]), atol=1e-5)
    # the same test rejects the uncut law (or another temperature): it has power at this size
    wrong = exact(LOGITS.tolist(), temperature) if (top_k or top_p < 1) else exact(LOGITS.tolist(), 0.8 * temperature)
    expected = [wrong[i] * n for i in range(len(LOGITS))]
    assert chisquare(observed.numpy(), expected).pvalue < 1e-6


def test_log_probs_are_the_cut_law_and_greedy_rows_are_one_hot():
    laws = RowLaws(1.0, 3, torch.device("cpu"))
    laws.assign([0, 1, 2], [(0.8, 4, 0.9), (0.0, 0, 1.0), (1.3, 0, 1.0)])
    got = laws.at(torch.arange(3)).log_probs(LOGITS.expand(3, 2, -1))  # two positions per row
    for row, (t, k, p) in enumerate([(0.8, 4, 0.9), (None, 0, 1.0), (1.3, 0, 1.0)]):
        if t is None:
            want = [0.0 if i == int(LOGITS.argmax()) else -math.inf for i in range(len(LOGITS))]
        else:
            want = [math.log(q) if q > 0 else -math.inf for q in exact(LOGITS.tolist(), t, k, p)]
        assert torch.allclose(got[row, 1], torch.tensor(want), atol=1e-5), row


def test_temperature_zero_is_argmax_with_zero_logprob_beside_sampled_rows():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    laws = RowLaws(0.0, 6, torch.device("cpu"))
    laws.assign([1, 3], [(1.0, 0, 1.0), (0.7, 10, 0.9)])
    law = laws.at(torch.arange(6))
    assert law.some_greedy and not law.greedy and law.truncates
    tokens, logprobs = law.sample(logits, combine(torch.tensor(3), torch.arange(6)))
    greedy = [0, 2, 4, 5]
    assert torch.equal(tokens[greedy], logits.argmax(-1)[greedy]) and torch.equal(logprobs[greedy], torch.zeros(4))
    assert bool((logprobs[[1, 3]] < 0).all())


def test_a_rows_draw_depends_on_its_key_alone():
    logits = torch.randn(7, 300, generator=torch.Generator().manual_seed(1))
    keys = combine(torch.tensor(11), torch.arange(7))
    law7 = law(7, 0.9, 40, 0.95)
    tokens, logprobs = law7.sample(logits, keys)
    for row in range(7):
        alone = law(1, 0.9, 40, 0.95).sample(logits[row : row + 1], keys[row : row + 1])
        assert alone[0].item() == tokens[row].item() and torch.allclose(alone[1], logprobs[row : row + 1])
    again, _ = law7.sample(logits, keys)
    other, _ = law7.sample(logits, combine(torch.tensor(12), torch.arange(7)))
    assert torch.equal(again, tokens) and not torch.equal(other, tokens)


def test_row_laws_know_what_is_assigned():
    laws = RowLaws(0.7, 4, torch.device("cpu"))
    assert not laws.greedy and not laws.truncates  # the configured temperature
    laws.assign([0], [(0.0, 0, 1.0)])
    assert not laws.greedy and laws.some_greedy  # the other rows keep the configured 0.7
    laws.assign([2], [(1.0, 0, 0.9)])
    assert laws.some_greedy and laws.truncates
    laws.clear([0, 2])
    assert not laws.some_greedy and not laws.truncates
    greedy = RowLaws(0.0, 2, torch.device("cpu"))
    assert greedy.greedy
    greedy.assign([1], [(0.5, 0, 1.0)])
    assert not greedy.greedy and greedy.some_greedy
    with pytest.raises(ValueError, match="temperature"):
        RowLaws(-0.5, 2, torch.device("cpu"))
