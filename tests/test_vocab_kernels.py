"""The one-pass vocabulary kernels (`hsmc.ops.vocab`, the CUDA path of the sampler and of the SMC weights) against
the exact law and the torch reference. Without a GPU they run through Triton's interpreter (conftest sets
TRITON_INTERPRET=1), one program at a time, so the draws here are few."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

pytest.importorskip("triton")

from hsmc.ops import vocab  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_gumbel_max_draws_follow_softmax_and_report_their_logprob():
    logits = torch.tensor([1.5, 0.2, -0.7, 0.9, -2.0], device=DEVICE)
    n, temperature = 1500, 0.8
    tokens, logprobs = vocab.gumbel_max(logits.expand(n, -1), temperature, torch.tensor([99], device=DEVICE))
    probs = torch.softmax(logits.double() / temperature, -1).cpu()
    observed = torch.bincount(tokens.cpu(), minlength=len(logits)).double()
    assert chisquare(observed.numpy(), (probs * n).numpy()).pvalue > 1e-3
    expected = torch.log_softmax(logits / temperature, -1)[tokens]
    assert torch.allclose(logprobs, expected, atol=1e-6)
    # the same check rejects draws at another temperature: it has power at this size
    wrong = torch.softmax(logits.double() / 0.4, -1).cpu()
    assert chisquare(observed.numpy(), (wrong * n).numpy()).pvalue < 1e-6


def test_gumbel_max_over_several_blocks(monkeypatch):
    """Rows longer than a block: the winner's token and log-prob come from the right block, the log-sum-exp
    from all of them, masked (-inf) entries never drawn; the same seed draws the same tokens."""
    monkeypatch.setattr(vocab, "BLOCK", 64)
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    logits[:, ::3] = float("-inf")
    seed = torch.tensor([7], device=DEVICE)
    tokens, logprobs = vocab.gumbel_max(logits, 0.7, seed)
    assert torch.equal(tokens, vocab.gumbel_max(logits, 0.7, seed)[0])
    assert not torch.equal(tokens, vocab.gumbel_max(logits, 0.7, torch.tensor([8], device=DEVICE))[0])
    assert bool((tokens % 3 != 0).all())
    reference = torch.log_softmax(logits / 0.7, -1).gather(1, tokens[:, None]).squeeze(1)
    assert torch.allclose(logprobs, reference, atol=1e-5)


def test_logsumexp_rows_is_float64_logsumexp(monkeypatch):
    monkeypatch.setattr(vocab, "BLOCK", 64)
    logits = (10 * torch.randn(5, 200, generator=torch.Generator().manual_seed(1))).to(torch.bfloat16).to(DEVICE)
    logits[2] = float("-inf")
    logits[2, 17] = 3.0
    got = vocab.logsumexp_rows(logits, 1 / 0.7)  # a scale float32 cannot hold
    want = torch.logsumexp(logits.double() / 0.7, -1)
    assert got.dtype == torch.float64
    assert torch.allclose(got, want, rtol=0, atol=1e-9)
