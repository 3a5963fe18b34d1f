"""The one-pass vocabulary kernels (`hsmc.ops.vocab`, the CUDA path of the sampler and of the SMC weights) against
the exact law and the torch reference. Without a GPU they run through Triton's interpreter (conftest sets
TRITON_INTERPRET=1), one program at a time (about 30 ms a row for a draw), so the draws here are few."""

from __future__ import annotations

import itertools

import numpy
import pytest
import torch
from scipy.stats import chisquare

pytest.importorskip("triton")

from hsmc.ops import vocab  # noqa: E402
from hsmc.ops.counter_hash import combine  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NO_FLOOR = float("-inf")


def _rows(values, dtype=torch.float32) -> torch.Tensor:
    return torch.as_tensor(values, dtype=dtype, device=DEVICE)


def _draw(logits, scale, floor, keys):
    """gumbel_max with per-row arguments given as lists (or tensors)."""
    return vocab.gumbel_max(logits, _rows(scale), _rows(floor), _rows(keys, torch.int64))


def _truncated_log_softmax(logits, scale, floor) -> torch.Tensor:
    """The reference law: log_softmax(logits * scale) over the entries >= floor, row by row (float32)."""
    logits = logits.float()
    scale, floor = _rows(scale)[:, None], _rows(floor)[:, None]
    return torch.where(logits >= floor, logits * scale, float("-inf")).log_softmax(-1)


def _chisquare_pvalue(tokens, probs, n) -> float:
    """Chi-square of the draws against the probabilities over the entries with mass (the others are checked
    never drawn by the caller)."""
    observed = torch.bincount(tokens.cpu(), minlength=len(probs)).double()
    support = probs > 0
    expected = probs[support] / probs[support].sum() * n
    return chisquare(observed[support].numpy(), expected.numpy()).pvalue


def test_draws_follow_the_tempered_softmax_and_report_their_logprob():
    """Rows with the same logits and different keys are independent draws from softmax(logits / T)."""
    logits = _rows([1.2, 0.2, -0.5, 0.7, -1.0])
    n, temperature = 300, 0.8
    tokens, logprobs = _draw(logits.expand(n, -1), [1 / temperature] * n, [NO_FLOOR] * n, range(1000, 1000 + n))
    probs = torch.softmax(logits.double() / temperature, -1).cpu()
    assert _chisquare_pvalue(tokens, probs, n) > 1e-3
    expected = torch.log_softmax(logits / temperature, -1)[tokens]
    assert torch.allclose(logprobs, expected, atol=1e-6)
    # the same check rejects draws at another temperature: it has power at this size
    wrong = torch.softmax(logits.double() / 0.4, -1).cpu()
    observed = torch.bincount(tokens.cpu(), minlength=len(logits)).double()
    assert chisquare(observed.numpy(), (wrong * n).numpy()).pvalue < 1e-6


def test_a_floor_truncates_and_renormalizes():
    """Two interleaved groups of rows, each with its own floor and temperature: entries under the floor are never
    drawn, the draws follow the renormalized truncated softmax, the log-prob is over the kept entries."""
    logits = _rows([1.5, 0.2, -0.7, 0.9, -2.0, 0.4, -0.3])
    n = 300
    scale = [1.0, 0.8] * (n // 2)  # group A: rows 0, 2, ...; group B: rows 1, 3, ...
    floor = [0.3, -0.5] * (n // 2)  # A keeps {1.5, 0.9, 0.4}; B drops -0.7 and -2.0
    tokens, logprobs = _draw(logits.expand(n, -1), scale, floor, range(5000, 5000 + n))
    assert bool((logits[tokens] >= _rows(floor)).all())  # excluded entries never drawn
    reference = _truncated_log_softmax(logits.expand(n, -1), scale, floor)
    assert torch.allclose(logprobs, reference.gather(1, tokens[:, None]).squeeze(1), atol=1e-6)
    for group in (0, 1):
        probs = reference[group].double().exp().cpu()
        assert _chisquare_pvalue(tokens[group::2], probs, n // 2) > 1e-3
    # without the floor, B would draw the dropped entries (mass 0.08) about 12 times in 150 draws
    assert torch.softmax(logits.double() * 0.8, -1)[[2, 4]].sum() > 0.08


def test_greedy_rows_take_the_argmax_among_sampling_rows(monkeypatch):
    """Scale-0 rows in a batch with sampling rows: exactly torch.argmax of the raw logits (the lowest index on a
    tie, within a block and across blocks), log-prob exactly 0, whatever the key or the floor."""
    monkeypatch.setattr(vocab, "BLOCK", 16)
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).to(DEVICE)
    logits[0, [5, 30]] = 4.0  # a tie across blocks
    logits[2, [21, 22]] = 4.0  # a tie within a block
    logits[2, ::4] = float("-inf")
    logits[4] = 0.0  # all tied
    scale = [0.0, 1.0, 0.0, 1 / 0.7, 0.0, 0.0]
    floor = [NO_FLOOR, NO_FLOOR, 3.0, 0.0, NO_FLOOR, 0.5]  # a floor changes nothing for a greedy row
    greedy = torch.tensor([0, 2, 4, 5])
    tokens, logprobs = _draw(logits, scale, floor, [11, 12, 13, 14, 15, 16])
    assert tokens[greedy].tolist()[:3] == [5, 21, 0]
    assert torch.equal(tokens[greedy], logits[greedy].argmax(-1))
    assert torch.equal(logprobs[greedy], torch.zeros(4, device=DEVICE))
    sampled = torch.tensor([1, 3])
    reference = _truncated_log_softmax(logits, scale, floor)[sampled].gather(1, tokens[sampled, None]).squeeze(1)
    assert torch.allclose(logprobs[sampled], reference, atol=1e-5)
    assert bool((logprobs[sampled] < 0).all())
    other_keys, _ = _draw(logits, scale, floor, [21, 22, 23, 24, 25, 26])
    assert torch.equal(other_keys[greedy], tokens[greedy])  # no noise


def test_a_rows_draw_depends_on_its_key_not_on_its_batch():
    """Each row of a 7-row batch (rows strided in a wider tensor, a greedy row among them) draws what it draws
    alone in a 1-row batch: same token, same log-prob. Rows that share logits and key draw alike wherever they
    sit; different keys draw differently."""
    wide = torch.randn(7, 64, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    logits = wide[:, :50]  # row stride 64
    scale = [1.0, 1 / 0.7, 0.5, 1.0, 1 / 0.9, 0.0, 2.0]
    floor = [NO_FLOOR, 0.0, NO_FLOOR, -0.5, NO_FLOOR, NO_FLOOR, 1.0]
    keys = [7, 2**40 + 3, -5, 123456789, 2**62 + 1, 9, 0]  # any int64
    tokens, logprobs = _draw(logits, scale, floor, keys)
    for r in range(7):
        alone = _draw(logits[r : r + 1], scale[r : r + 1], floor[r : r + 1], keys[r : r + 1])
        assert (alone[0].item(), alone[1].item()) == (tokens[r].item(), logprobs[r].item()), r
    # row 4's arguments at row 4 of another 7-row batch: other logits, scales, floors and keys around it
    others = torch.randn(7, 50, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    others[4] = logits[4]
    other_scale, other_floor = [0.5, 2.0, 0.0, 1.0, scale[4], 1.0, 0.0], [0.0] * 4 + [floor[4]] + [NO_FLOOR] * 2
    other = _draw(others, other_scale, other_floor, [1, 2, 3, 4, keys[4], 5, 6])
    assert (other[0][4].item(), other[1][4].item()) == (tokens[4].item(), logprobs[4].item())

    flat = torch.zeros(16, 50, device=DEVICE)  # uniform over 50 entries
    same = _draw(flat, [1.0] * 16, [NO_FLOOR] * 16, [42] * 16)[0]
    assert bool((same == same[0]).all())  # the row index is not in the counter
    different = _draw(flat, [1.0] * 16, [NO_FLOOR] * 16, range(16))[0]
    assert len(set(different.tolist())) > 4  # 16 independent uniform draws over 50 entries
    high = _draw(flat, [1.0] * 16, [NO_FLOOR] * 16, [2**40 + k for k in range(16)])[0]
    assert not torch.equal(high, different)  # the key's high 32 bits are part of the Philox key


def test_draws_over_several_blocks(monkeypatch):
    """Rows longer than a block: the winner's token and log-prob come from the right block, the log-sum-exp
    from all of them, masked (-inf) and floored entries never drawn; the same keys draw the same tokens."""
    monkeypatch.setattr(vocab, "BLOCK", 64)
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    logits[:, ::3] = float("-inf")
    top8 = logits[3].topk(8).values[-1].item()  # a top-k floor: 8 entries kept
    scale = [1 / 0.7, 1.0, 0.0, 1.0, 1 / 0.7, 0.5]
    floor = [NO_FLOOR, 0.5, NO_FLOOR, top8, NO_FLOOR, 1.0]
    keys = [7, 8, 9, 10, 11, 12]
    tokens, logprobs = _draw(logits, scale, floor, keys)
    assert torch.equal(tokens, _draw(logits, scale, floor, keys)[0])
    assert not torch.equal(tokens, _draw(logits, scale, floor, [k + 100 for k in keys])[0])
    assert bool((tokens % 3 != 0).all())
    assert bool((logits.gather(1, tokens[:, None]).squeeze(1) >= _rows(floor)).all())
    assert tokens[2].item() == logits[2].argmax().item() and logprobs[2].item() == 0.0
    sampled = torch.tensor([0, 1, 3, 4, 5])
    reference = _truncated_log_softmax(logits, scale, floor).gather(1, tokens[:, None]).squeeze(1)
    assert torch.allclose(logprobs[sampled], reference[sampled], atol=1e-5)


def test_logsumexp_rows_is_float64_logsumexp_over_the_kept_entries(monkeypatch):
    """Per-row float64 scales (one float32 cannot hold) and floors against torch's float64 logsumexp over the
    kept entries; a row with nothing kept gives -inf."""
    monkeypatch.setattr(vocab, "BLOCK", 64)
    wide = (10 * torch.randn(6, 256, generator=torch.Generator().manual_seed(1))).to(torch.bfloat16).to(DEVICE)
    logits = wide[:, :200]  # row stride 256
    logits[2] = float("-inf")
    logits[2, 17] = 3.0
    logits[5] = float("-inf")
    scale = torch.tensor([1 / 0.7, 1.0, 1 / 0.7, 0.5, 2.0, 1.0], dtype=torch.float64, device=DEVICE)
    floor = _rows([NO_FLOOR, 0.0, NO_FLOOR, 5.0, 1e4, NO_FLOOR])  # row 4: nothing kept; row 5: all -inf
    got = vocab.logsumexp_rows(logits, scale, floor)

    def reference(scale):
        kept = logits.float() >= floor[:, None]
        return torch.where(kept, logits.double() * scale[:, None], float("-inf")).logsumexp(-1)

    assert got.dtype == torch.float64
    assert torch.allclose(got, reference(scale), rtol=0, atol=1e-9)
    assert got[4].item() == float("-inf") and got[5].item() == float("-inf")
    # a float32 scale would miss by far more than the tolerance
    rounded = scale.float().double()
    assert (reference(rounded) - reference(scale))[0].abs() > 1e-7


@pytest.mark.parametrize("positions", ["rows", "rows x 3", "one int"])
def test_the_stream_keys_kernel_gives_the_references_bits(positions):
    """`stream_keys` (one kernel) against `counter_hash.keys_of_draws` on key[rows] (about forty torch ops): the same
    int64 keys for repeated and unordered rows, keys and positions across all 64 bits, and every purpose kind (a
    level's draws, acceptance, resampling ids)."""
    from hsmc.ops.counter_hash import keys_of_draws
    from hsmc.ops.stream_keys import stream_keys

    g = torch.Generator().manual_seed(3)
    key = torch.randint(-(2**63), 2**63 - 1, (9,), dtype=torch.int64, generator=g).to(DEVICE)
    rows = torch.tensor([3, 0, 8, 3, 5, 1, 0], device=DEVICE)
    for purpose in (0, 5, 8 * 3 + 1, 2**40):
        given = {
            "rows": torch.randint(0, 2**62, (7,), generator=g),
            "rows x 3": torch.randint(-(2**63), 2**63 - 1, (7, 3), generator=g),
            "one int": 12345,
        }[positions]
        given = given.to(DEVICE) if isinstance(given, torch.Tensor) else given
        expected = keys_of_draws(key[rows], purpose, given)
        got = stream_keys(key, rows, purpose, given)
        assert got.shape == expected.shape and torch.equal(got, expected)


def test_gumbel_top_k_draws_children_without_replacement_in_draw_order(monkeypatch):
    """3 children from a law of 3 tokens with mass (and one without), 400 keys: the orders follow the law of draws
    without replacement, P(a, b, c) = q_a q_b / (1 - q_a), and not that of independent draws kept only when
    distinct (P ∝ q_a q_b q_c, the same for every order): the children come in draw order. The slot values are
    torch's top-k values exactly."""
    monkeypatch.setattr(vocab, "TOP_K_BLOCK", 8)  # one block: the interpreter runs a program's lanes in numpy
    logq = torch.log(_rows([0.7, 0.0, 0.2, 0.1]))
    n = 400
    keys = combine(torch.tensor(7, device=DEVICE), torch.arange(n, device=DEVICE))
    tokens, slots = vocab.gumbel_top_k(logq.expand(n, -1), keys, 3)
    assert torch.equal(slots, logq.topk(3).values.expand(n, -1))
    orders = list(itertools.permutations([0, 2, 3]))  # token 1 has no mass: never drawn while others remain
    observed = torch.tensor([float((tokens.cpu() == torch.tensor(order)).all(-1).sum()) for order in orders])
    assert observed.sum() == n
    q = logq.double().exp().cpu()
    exact = torch.tensor([q[a] * q[b] / (1 - q[a]) for a, b, _ in orders])
    assert chisquare(observed.numpy(), (exact / exact.sum() * n).numpy()).pvalue > 1e-3
    assert chisquare(observed.numpy(), numpy.full(len(orders), n / len(orders))).pvalue < 1e-6


def test_gumbel_top_k_over_several_blocks_and_laws_without_enough_mass(monkeypatch):
    """Laws [2, 3, 50] over 4 blocks of 16 (the last one short), some entries without mass: k distinct columns of
    the vocabulary per law, those with mass first; slot values equal torch's top-k values (-inf included), the
    draws depend on the key alone; a law with exactly k tokens of mass draws those, one with fewer draws them
    first."""
    monkeypatch.setattr(vocab, "TOP_K_BLOCK", 16)
    g = torch.Generator().manual_seed(3)
    logits = 2.0 * torch.randn(2, 3, 50, generator=g)
    logits[torch.rand(2, 3, 50, generator=g) < 0.3] = float("-inf")
    logits[1, 1] = float("-inf")
    logits[1, 1, [5, 33, 49, 17]] = torch.tensor([0.5, -1.0, 2.0, 0.1])  # exactly k = 4 with mass
    logits[1, 2] = float("-inf")
    logits[1, 2, [40, 2]] = torch.tensor([1.0, 1.5])  # fewer than k
    logq = torch.log_softmax(logits, -1).to(DEVICE)
    keys = torch.arange(6, device=DEVICE).view(2, 3) * 1_000_003
    tokens, slots = vocab.gumbel_top_k(logq, keys, 4)
    assert tokens.shape == slots.shape == (2, 3, 4)
    assert torch.equal(slots, logq.topk(4).values)
    assert bool((tokens >= 0).all() & (tokens < 50).all())
    assert all(len(set(law.tolist())) == 4 for law in tokens.view(-1, 4))
    with_mass = logq.gather(-1, tokens) > float("-inf")
    assert bool(with_mass.view(-1, 4)[[0, 1, 2, 3]].all())  # the first four laws have at least 4 with mass
    assert set(tokens[1, 1].tolist()) == {5, 33, 49, 17}
    assert set(tokens[1, 2, :2].tolist()) == {40, 2} and bool((~with_mass[1, 2, 2:]).all())
    alone, _ = vocab.gumbel_top_k(logq[0, 1], keys[0, 1], 4)
    assert torch.equal(alone, tokens[0, 1])
