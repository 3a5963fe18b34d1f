"""The one-pass vocabulary kernels (`hsmc.ops.vocab`) compiled, over a whole Qwen3 vocabulary (151,936 logits,
37 blocks per row): Gumbel-max draws against the exact tempered softmax, the log-probabilities they report, and
float64 log-sum-exps against torch. tests/test_vocab_kernels.py checks the same laws interpreted, on few draws."""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

VOCAB = 151_936


def per_row(value: float, rows: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.full((rows,), value, dtype=dtype, device="cuda")


def test_draws_over_a_full_vocabulary_follow_the_tempered_softmax():
    """200,000 draws at T = 0.8 from one bf16 row, binned as the 20 likeliest tokens and the rest: the chi-square
    p-value is that of a fair sampler (keys are fixed, so the test is deterministic; a correct sampler fails it
    for one key set in 10^4). Each draw's log-probability equals the float64 log-softmax to float32 precision."""
    from scipy.stats import chisquare

    from hsmc.ops.counter_hash import combine
    from hsmc.ops.vocab import gumbel_max

    n, temperature = 200_000, 0.8
    gen = torch.Generator("cuda").manual_seed(0)
    row = (torch.randn(VOCAB, device="cuda", generator=gen) * 2.5).to(torch.bfloat16)
    keys = combine(torch.tensor(11, device="cuda"), torch.arange(n, device="cuda"))
    tokens, logprobs = gumbel_max(row.expand(n, -1), per_row(1 / temperature, n), per_row(-math.inf, n), keys)
    law = torch.log_softmax(row.double() / temperature, -1)
    top = law.topk(20).indices
    bins = torch.full((VOCAB,), 20, dtype=torch.int64, device="cuda")
    bins[top] = torch.arange(20, device="cuda")
    observed = torch.bincount(bins[tokens], minlength=21).double().cpu()
    probs = law[top].exp()
    expected = torch.cat([probs, (1 - probs.sum())[None]]).cpu() * n
    assert chisquare(observed.numpy(), expected.numpy()).pvalue > 1e-4
    assert (logprobs.double() - law[tokens]).abs().max().item() < 1e-4  # measured 8e-7


def test_float64_logsumexp_of_full_vocabulary_rows():
    """The tempered log-sum-exp the SMC weights use, accumulated in float64 over 37 blocks per row: equal to torch's
    float64 logsumexp up to float64 rounding (measured 3e-14; a float32 partial would be off by ~1e-6)."""
    from hsmc.ops.vocab import logsumexp_rows

    gen = torch.Generator("cuda").manual_seed(1)
    logits = torch.randn(72, VOCAB, device="cuda", generator=gen).to(torch.bfloat16) * 3
    lse = logsumexp_rows(logits, per_row(1 / 0.7, 72, torch.float64), per_row(-math.inf, 72))
    assert lse.dtype == torch.float64
    assert (lse - torch.logsumexp(logits.double() / 0.7, -1)).abs().max().item() < 1e-9


def test_the_stream_keys_kernel_gives_the_references_bits_on_cuda():
    """`stream_keys` compiled, over 65,536 rows x 8 positions (512 programs of 1,024) drawn across all 64 bits,
    repeated rows, and an int position: the same int64 keys as `counter_hash.keys_of_draws` on key[rows] (torch's
    int64 ops on the GPU wrap as splitmix64's uint64 products do)."""
    from hsmc.ops.counter_hash import keys_of_draws
    from hsmc.ops.stream_keys import stream_keys

    gen = torch.Generator("cuda").manual_seed(2)
    key = torch.randint(-(2**63), 2**63 - 1, (4096,), dtype=torch.int64, device="cuda", generator=gen)
    rows = torch.randint(0, 4096, (65_536,), device="cuda", generator=gen)
    positions = torch.randint(-(2**63), 2**63 - 1, (65_536, 8), dtype=torch.int64, device="cuda", generator=gen)
    for purpose in (0, 8 * 2 + 1, 2**40):
        assert torch.equal(stream_keys(key, rows, purpose, positions), keys_of_draws(key[rows], purpose, positions))
        assert torch.equal(
            stream_keys(key, rows, purpose, positions[:, 0]), keys_of_draws(key[rows], purpose, positions[:, 0])
        )
        assert torch.equal(stream_keys(key, rows, purpose, 77), keys_of_draws(key[rows], purpose, 77))


def test_gumbel_top_k_over_a_full_vocabulary_draws_children_without_replacement():
    """4 children of one law over 151,936 tokens (5 heavy tokens across the blocks, the rest light), 20,000 keys:
    the (first, second) children follow the law of draws without replacement, P(a, b) = q_a q_b / (1 - q_a)
    (the light tokens one bin); the 4 children are distinct; the slot values are torch's top-k values."""
    from scipy.stats import chisquare

    from hsmc.ops.counter_hash import combine
    from hsmc.ops.vocab import gumbel_top_k

    n = 20_000
    heavy = torch.tensor([17, 40_000, 75_000, 120_000, VOCAB - 1], device="cuda")
    logits = torch.full((VOCAB,), -11.0, device="cuda")
    logits[heavy] = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0], device="cuda")
    logq = torch.log_softmax(logits, -1)
    keys = combine(torch.tensor(5, device="cuda"), torch.arange(n, device="cuda"))
    tokens, slots = gumbel_top_k(logq.expand(n, -1), keys, 4)
    assert torch.equal(slots, logq.topk(4).values.expand(n, -1))
    assert bool((tokens.sort(-1).values.diff(dim=-1) > 0).all())
    bins = torch.full((VOCAB,), 5, dtype=torch.int64, device="cuda")
    bins[heavy] = torch.arange(5, device="cuda")
    first, second = bins[tokens[:, 0]], bins[tokens[:, 1]]
    observed = torch.bincount(first * 6 + second, minlength=36).double().cpu()
    q = torch.cat([logq[heavy].double().exp(), (1 - logq[heavy].double().exp().sum())[None]]).cpu()
    exact = q[:, None] * q[None, :] / (1 - q[:, None])
    exact[torch.arange(5), torch.arange(5)] = 0.0  # a heavy token drawn twice: never (the light bin may repeat)
    light = logq[0].double().exp().cpu()  # one light token's mass: what a light first child takes from the rest
    exact[5] = q[5] * q / (1 - light)
    exact[5, 5] = q[5] * (q[5] - light) / (1 - light)  # a light first, another light second
    support = exact.flatten() > 0
    assert observed.flatten()[~support].sum() == 0
    expected = exact.flatten()[support]
    assert chisquare(observed.flatten()[support].numpy(), (expected / expected.sum() * n).numpy()).pvalue > 1e-4
