"""Gumbel-max draws follow softmax(l/T); the returned log-prob is log_softmax(l/T) at the draw."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from hsmc.engine.sampler import sample


@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_empirical_distribution_matches_softmax(temperature):
    logits = torch.tensor([2.0, 0.5, -1.0, 1.2, 0.0, -3.0, 1.9, 0.3])
    n = 200_000
    gen = torch.Generator().manual_seed(1234)
    tokens, logprobs = sample(logits.expand(n, -1), temperature, gen)
    probs = torch.softmax(logits.double() / temperature, -1)
    observed = torch.bincount(tokens, minlength=len(logits)).double()
    result = chisquare(observed.numpy(), (probs * n).numpy())
    assert result.pvalue > 1e-3, f"chi2={result.statistic:.1f} p={result.pvalue:.2e}"
    expected_lp = torch.log_softmax(logits / temperature, -1)[tokens]
    assert torch.allclose(logprobs, expected_lp, atol=1e-6)


def test_a_wrong_distribution_is_rejected():
    """The chi-square check has power: draws at T=1 do not pass as draws at T=0.8."""
    logits = torch.tensor([2.0, 0.5, -1.0, 1.2])
    tokens, _ = sample(logits.expand(200_000, -1), 1.0, torch.Generator().manual_seed(0))
    probs = torch.softmax(logits.double() / 0.8, -1)
    assert chisquare(torch.bincount(tokens, minlength=4).double().numpy(), (probs * 200_000).numpy()).pvalue < 1e-6


def test_temperature_zero_is_argmax_with_zero_logprob():
    logits = torch.randn(5, 3, 50, generator=torch.Generator().manual_seed(0))
    tokens, logprobs = sample(logits, 0.0, None)
    assert torch.equal(tokens, logits.argmax(-1))
    assert torch.equal(logprobs, torch.zeros(5, 3))


def test_seeded_generator_reproduces_draws():
    logits = torch.randn(64, 1000)
    a, _ = sample(logits, 1.0, torch.Generator().manual_seed(7))
    b, _ = sample(logits, 1.0, torch.Generator().manual_seed(7))
    c, _ = sample(logits, 1.0, torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_negative_temperature_is_rejected():
    with pytest.raises(ValueError, match="temperature"):
        sample(torch.zeros(3), -0.5, None)
