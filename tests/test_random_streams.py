"""Counter-based random streams: the same bits for a host int and a device tensor, uniform numbers, keys that differ
by row, purpose and position, and resampling's fresh keys."""

from __future__ import annotations

import torch
from scipy.stats import kstest

from hsmc.engine.random_streams import RENEW, RowStreams
from hsmc.ops.counter_hash import combine, gumbel, mix, uniform


def test_mix_is_splitmix64_and_an_int_hashes_as_its_tensor():
    mask = (1 << 64) - 1

    def splitmix(x: int) -> int:
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
        x ^= x >> 31
        return x - (1 << 64) if x >= 1 << 63 else x

    values = [0, 1, 2, 12345, -7, 2**62 + 3]
    assert mix(torch.tensor(values)).tolist() == [splitmix(v & mask) for v in values]
    keys = torch.tensor([3, -9, 2**61])
    for value in (0, 1, RENEW, 10**12):
        assert torch.equal(combine(keys, value), combine(keys, torch.tensor(value)))


def test_uniforms_are_uniform_and_gumbel_noise_is_gumbel():
    u = uniform(combine(torch.tensor(11), torch.arange(100_000)))
    assert 0 < u.min() and u.max() < 1
    assert kstest(u.numpy(), "uniform").pvalue > 1e-3
    g = gumbel(torch.tensor([5]), 50_000)[0].double()
    assert kstest(g.numpy(), "gumbel_r").pvalue > 1e-3


def test_keys_differ_by_row_purpose_and_position_and_renewal_touches_only_the_resampled_rows():
    streams = RowStreams(4, torch.device("cpu"))
    streams.seed(torch.arange(4), torch.tensor([7, 7, 7, 8]), torch.tensor([0, 1, 2, 0]))
    rows = torch.arange(4)
    keys = [streams.keys(rows, purpose, torch.tensor([5, 5, 5, 5])) for purpose in (1, 2)]
    every = torch.cat([*keys, streams.keys(rows, 1, torch.tensor([6, 6, 6, 6]))])
    assert len(set(every.tolist())) == 12  # rows, purposes and positions all apart
    assert torch.equal(streams.keys(rows, 1, torch.tensor([5, 5, 5, 5])), keys[0])  # a draw is its key's alone
    before = streams.key.clone()
    streams.renew(rows, torch.tensor([True, False, True, False]))
    changed = (streams.key[:4] != before[:4]).tolist()
    assert changed == [True, False, True, False]
