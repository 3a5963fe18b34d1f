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
