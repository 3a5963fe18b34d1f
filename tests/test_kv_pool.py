"""Refcount invariants of the slot pool under random fan-out / copy / rollback / release."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_pools_empty
from hypothesis import given, settings
from hypothesis import strategies as st

from hsmc.engine.kv_pool import BlockTables, SlotAllocator, check_invariants
from hsmc.errors import KVCapacityError

ROWS, WIDTH, SLOTS = 6, 24, 96

op = st.one_of(
    st.tuples(  # ragged: each row gets its own count (0 allowed), the width is the largest plus padding
        st.just("append"),
        st.lists(
            st.tuples(st.integers(0, ROWS - 1), st.integers(0, 5)), min_size=1, max_size=3, unique_by=lambda x: x[0]
        ),
        st.integers(0, 2),
    ),
    st.tuples(
        st.just("fork"),
        st.lists(st.tuples(st.integers(0, ROWS - 1), st.integers(0, ROWS - 1)), min_size=1, max_size=ROWS),
    ),
    st.tuples(
        st.just("rollback"), st.lists(st.integers(0, ROWS - 1), min_size=1, max_size=3, unique=True), st.integers(0, 4)
    ),
    st.tuples(st.just("release"), st.lists(st.integers(0, ROWS - 1), min_size=1, max_size=3, unique=True)),
    st.tuples(  # rows cut back to a new length (rows already shorter keep theirs), at most 5 tokens each
        st.just("truncate"),
        st.lists(
            st.tuples(st.integers(0, ROWS - 1), st.integers(0, WIDTH)), min_size=1, max_size=3, unique_by=lambda x: x[0]
        ),
    ),
)


def _model_refcounts(rows: list[list[int]]) -> dict[int, int]:
    counts: dict[int, int] = {}
    for row in rows:
        for s in row:
            counts[s] = counts.get(s, 0) + 1
    return counts


@settings(max_examples=150, deadline=None)
@given(st.lists(op, max_size=40))
def test_random_operation_sequences_keep_invariants(ops):
    alloc = SlotAllocator(SLOTS)
    tables = BlockTables(alloc, ROWS, WIDTH)
    model: list[list[int]] = [[] for _ in range(ROWS)]  # plain-Python mirror of every row's slots
    for kind, *args in ops:
        if kind == "append":
            pairs, pad = args
            rows, counts = [r for r, _ in pairs], [c for _, c in pairs]
            if any(len(model[r]) + c > WIDTH for r, c in pairs) or alloc.num_free() < sum(counts):
                continue
            slots, _, _ = tables.append(torch.tensor(rows), torch.tensor(counts), max(counts) + pad)
            for r, c, new in zip(rows, counts, slots.tolist()):
                assert all(s not in _model_refcounts(model) for s in new[:c]), "allocated a slot that is in use"
                assert all(s == alloc.trash_slot for s in new[c:]), "padding must get the trash slot"
                model[r].extend(new[:c])
        elif kind == "fork":
            pairs = dict((dst, src) for src, dst in args[0])  # one source per destination
            dst, src = list(pairs), list(pairs.values())
            tables.copy_block_table(torch.tensor(src), torch.tensor(dst))
            snapshot = [list(row) for row in model]
            for d, s in zip(dst, src):
                model[d] = list(snapshot[s])
        elif kind == "rollback":
            rows, n = args
            counts = [min(n, len(model[r])) for r in rows]
            tables.rollback(torch.tensor(rows), torch.tensor(counts), 4)
            for r, c in zip(rows, counts):
                del model[r][len(model[r]) - c :]
        elif kind == "truncate":
            rows, keep = _truncation(args[0], [len(row) for row in model])
            tables.truncate(torch.tensor(rows), torch.tensor(keep), 5)
            for r, k in zip(rows, keep):
                del model[r][k:]
        else:
            tables.release(torch.tensor(args[0]))
            for r in args[0]:
                model[r] = []
        check_invariants(alloc, [tables])
        for r in range(ROWS):
            assert tables.table[r, : int(tables.length[r])].tolist() == model[r]
        expected = torch.zeros(SLOTS, dtype=torch.int32)
        for s, c in _model_refcounts(model).items():
            expected[s] = c
        assert torch.equal(alloc.refcount[:SLOTS], expected)
    tables.release(torch.arange(ROWS))
    check_invariants(alloc, [tables])
    assert alloc.num_free() == SLOTS, "pool did not return to empty"


def _truncation(pairs: list[tuple[int, int]], lengths: list[int]) -> tuple[list[int], list[int]]:
    """A truncate op's rows and new lengths, each dropping at most 5 tokens (its host-known bound)."""
    return [r for r, _ in pairs], [max(k, lengths[r] - 5) for r, k in pairs]


def _apply(tables: BlockTables, kind: str, args: list) -> None:
    """One of `op`'s operations but an append."""
    if kind == "fork":
        pairs = dict((dst, src) for src, dst in args[0])
        tables.copy_block_table(torch.tensor(list(pairs.values())), torch.tensor(list(pairs)))
    elif kind == "rollback":
        rows, n = args
        counts = [min(n, int(tables.length[r])) for r in rows]
        tables.rollback(torch.tensor(rows), torch.tensor(counts), 4)
    elif kind == "truncate":
        rows, keep = _truncation(args[0], tables.length.tolist())
        tables.truncate(torch.tensor(rows), torch.tensor(keep), 5)
    else:
        tables.release(torch.tensor(args[0]))


def _assert_same(ref: BlockTables, dev: BlockTables) -> None:
    assert torch.equal(dev.allocator.refcount, ref.allocator.refcount)
    assert torch.equal(dev.length, ref.length)
    for r in range(ROWS):
        n = int(ref.length[r])
        assert torch.equal(dev.table[r, :n], ref.table[r, :n])


@settings(max_examples=40, deadline=None)
@given(st.lists(op, max_size=25), st.sampled_from([16, 32, 1024]))
def test_device_append_and_rollback_match_the_reference(ops, chunk):
    """The two-kernel append and the one-kernel rollback / truncate of CUDA (`hsmc.ops.kv_slots`, here through
    Triton's interpreter) leave the same refcounts, tables and lengths, and the append returns the same slots, as
    the torch ops, whatever holes earlier forks, rollbacks and releases left; chunks of 16 and 32 slots make the
    append walk several of the pool's chunks."""
    pytest.importorskip("triton")
    from hsmc.ops.kv_slots import append_slots, rollback_slots

    ref, dev = BlockTables(SlotAllocator(SLOTS), ROWS, WIDTH), BlockTables(SlotAllocator(SLOTS), ROWS, WIDTH)
    for kind, *args in ops:
        if kind in ("rollback", "truncate"):
            if kind == "rollback":
                rows, n = args
                values, max_drop = [min(n, int(ref.length[r])) for r in rows], 4
            else:
                (rows, values), max_drop = _truncation(args[0], ref.length.tolist()), 5
            _apply(ref, kind, args)
            ok = rollback_slots(dev.allocator.refcount, dev.table, dev.length, torch.tensor(rows),
                                torch.tensor(values), max_drop, kind == "truncate")  # fmt: skip
            assert ok.tolist() == [1, 1]
            _assert_same(ref, dev)
            continue
        if kind != "append":
            for tables in (ref, dev):
                _apply(tables, kind, args)
            continue
        pairs, pad = args
        rows, counts = torch.tensor([r for r, _ in pairs]), torch.tensor([c for _, c in pairs])
        if bool((ref.length[rows] + counts > WIDTH).any()) or ref.allocator.num_free() < int(counts.sum()):
            continue
        want = ref.append(rows, counts, int(counts.max()) + pad)
        *got, ok = append_slots(dev.allocator.refcount, dev.table, dev.length, rows, counts, want[0].shape[1], WIDTH,
                                chunk)  # fmt: skip
        assert ok.tolist() == [1, 1]
        assert all(torch.equal(g, w) for g, w in zip(got, want)), "slots, start and columns"
        _assert_same(ref, dev)
    check_invariants(dev.allocator, [dev])


def test_device_append_flags_what_the_reference_asserts():
    pytest.importorskip("triton")
    from hsmc.ops.kv_slots import append_slots

    tables = BlockTables(SlotAllocator(8), 2, 6)
    *_, ok = append_slots(tables.allocator.refcount, tables.table, tables.length, torch.tensor([0, 1]),
                         torch.tensor([4, 5]), 5, 6, 4)  # fmt: skip
    assert ok.tolist() == [0, 1], "9 slots wanted from 8"
    tables = BlockTables(SlotAllocator(8), 2, 6)
    *_, ok = append_slots(tables.allocator.refcount, tables.table, tables.length, torch.tensor([1]),
                         torch.tensor([7]), 7, 6, 4)  # fmt: skip
    assert ok.tolist() == [1, 0], "7 tokens in a table of 6"


def test_device_rollback_flags_what_the_reference_asserts():
    pytest.importorskip("triton")
    from hsmc.ops.kv_slots import rollback_slots

    def rollback(rows, values, max_drop, to_length, released_slot=None):
        tables = BlockTables(SlotAllocator(8), 2, 6)
        tables.append(torch.tensor([0, 1]), torch.tensor([3, 2]), 3)  # rows of 3 and 2 tokens
        if released_slot is not None:  # a slot row 1 still lists, released behind its back
            tables.allocator.refcount[tables.table[1, released_slot]] = 0
        args = (tables.allocator.refcount, tables.table, tables.length, torch.tensor(rows), torch.tensor(values))
        return rollback_slots(*args, max_drop, to_length).tolist()

    assert rollback([0, 1], [1, 2], 2, False) == [1, 1]
    assert rollback([1], [3], 4, False) == [0, 1], "3 tokens dropped from a row of 2"
    assert rollback([0], [3], 2, False) == [0, 1], "3 tokens dropped, at most 2 allowed"
    assert rollback([0], [0], 2, True) == [0, 1], "truncated by 3 tokens, at most 2 allowed"
    assert rollback([0], [5], 0, True) == [1, 1], "a row already shorter keeps its length"
    assert rollback([1], [1], 1, False, released_slot=1) == [1, 0]


def test_fan_out_shares_slots_and_frees_on_last_owner():
    alloc = SlotAllocator(32)
    tables = BlockTables(alloc, 4, 16)
    tables.append(torch.tensor([0]), torch.tensor([5]), 5)
    tables.copy_block_table(torch.tensor([0, 0, 0]), torch.tensor([1, 2, 3]))
    assert alloc.num_free() == 27
    tables.release(torch.tensor([0, 1, 2]))
    assert alloc.num_free() == 27, "slots freed while row 3 still references them"
    tables.release(torch.tensor([3]))
    assert alloc.num_free() == 32


def test_resampling_permutation_with_overlapping_rows():
    """dst <- src where destinations are also sources (a resampling step) moves no slot ids wrongly."""
    alloc = SlotAllocator(64)
    tables = BlockTables(alloc, 4, 16)
    for r in range(4):
        tables.append(torch.tensor([r]), torch.tensor([r + 1]), r + 1)
    before = [tables.table[r, : r + 1].tolist() for r in range(4)]
    ancestors = [2, 2, 0, 3]  # particle i takes the state of ancestors[i]
    tables.copy_block_table(torch.tensor(ancestors), torch.arange(4))
    for r, a in enumerate(ancestors):
        assert tables.table[r, : int(tables.length[r])].tolist() == before[a]
    check_invariants(alloc, [tables])
    assert alloc.num_free() == 64 - (3 + 1 + 4)  # row 1's slots were freed, rows 0/2 share row 2's


def test_errors_on_misuse():
    alloc = SlotAllocator(8)
    tables = BlockTables(alloc, 2, 6)
    with pytest.raises(RuntimeError, match="out of slots"):
        alloc.alloc(torch.tensor([4, 5]), 5)
    with pytest.raises(RuntimeError, match="longer than its block table"):
        tables.append(torch.tensor([0]), torch.tensor([7]), 7)
    slots = alloc.alloc(torch.tensor([2]), 2)[0]
    alloc.add_refs(slots[:1], torch.ones(1))  # a second owner of the first slot
    with pytest.raises(RuntimeError, match="shared or already free"):
        alloc.free(slots)
    alloc.add_refs(slots, -torch.ones(2))  # each owner lets go once: the first slot keeps one owner
    alloc.free(slots[:1])
    with pytest.raises(RuntimeError, match="more often than it was referenced"):
        alloc.add_refs(slots[1:], -torch.ones(1))


def test_admission_reserves_rows_and_slots_first_come_first_served():
    from hsmc.engine.scheduler import Admission

    def queued(a: Admission, lengths: list[int], max_tokens: int, rows: list[int] | None = None) -> Admission:
        for i, n in enumerate(lengths):
            a.add(i, n, max_tokens, 1 if rows is None else rows[i])
        return a

    # rows: two row groups; a third prompt joins when one of them finishes
    a = queued(Admission(max_rows=2, capacity=64, lookahead=0), [3, 3, 3], 4)
    assert a.admit() == [(0, 0), (1, 1)] and a.admit() == []
    a.finish(1)
    assert a.admit() == [(2, 1)]
    a.finish(0), a.finish(2)
    assert a.running == 0 and not a.waiting and a.free_slots == 64
    # slots for the whole request: 10+6 + 20+6 = 42 <= 45; 5+6 more would be 53
    a = queued(Admission(max_rows=8, capacity=45, lookahead=0), [10, 20, 5], 6)
    assert a.admit() == [(0, 0), (1, 1)]
    a.finish(0)
    assert a.admit() == [(2, 0)]
    # in order: prompt 1 (41 slots) does not fit beside prompt 0 (31) and holds back prompt 2 (3)
    a = queued(Admission(max_rows=8, capacity=60, lookahead=0), [30, 40, 2], 1)
    assert a.admit() == [(0, 0)]
    a.finish(0)
    assert a.admit() == [(1, 0), (2, 1)]
    # a waiting request that is withdrawn no longer holds the others back
    a = queued(Admission(max_rows=8, capacity=60, lookahead=0), [30, 40, 2], 1)
    assert a.admit() == [(0, 0)]
    a.finish(1)
    assert a.admit() == [(2, 1)]
    # an SMC request takes N consecutive rows: 10 rows hold two groups of 4
    a = queued(Admission(max_rows=10, capacity=200, lookahead=0, default_group=4), [3, 3, 3], 4, [4, 4, 4])
    assert a.admit() == [(0, 0), (1, 1)] and a.group_size == 4
    # different N per request: groups of the largest N's rows, slots by each request's own N (3+1*4, 3+3*4, 3+2*4)
    a = queued(Admission(max_rows=6, capacity=200, lookahead=0), [3, 3, 3], 4, [1, 3, 2])
    assert [a.needs[i] for i in range(3)] == [7, 15, 11] and a.admit() == [(0, 0), (1, 1)] and a.group_size == 3
    # a request wanting more rows than the running groups have waits until nothing runs, then regroups
    a = queued(Admission(max_rows=8, capacity=200, lookahead=0, default_group=2), [3], 4, [2])
    assert a.admit() == [(0, 0)]
    a.add(1, 3, 4, 4)
    assert a.admit() == [] and a.group_size == 2
    a.finish(0)
    assert a.admit() == [(1, 0)] and a.group_size == 4
    # the problem of a request that could never fit, lookahead included
    a = Admission(max_rows=8, capacity=64, lookahead=1)
    assert a.problem(3, 20, 1) is None
    assert "it needs 71 KV slots, more than engine.kv_capacity_tokens=64" in a.problem(50, 20, 1)
    assert "max_batch_rows=8" in a.problem(3, 1, 9)
    with pytest.raises(KVCapacityError, match="prompt 1 has 50 tokens"):
        a.check([3, 50], [20, 20], [1, 1])


def test_generation_never_runs_out_of_slots_with_one_long_prompt(tmp_path):
    """A long prompt among short ones: the padded prefill's transient need is budgeted."""
    from conftest import make_tiny_model

    from hsmc.decoder import HierarchicalDecoder

    path = make_tiny_model("llama", tmp_path / "m")
    decoder = HierarchicalDecoder.from_config(
        {"levels": [{"model": str(path)}], "engine": {"kv_capacity_tokens": 100, "max_batch_rows": 8}}
    )
    prompts = [list(range(3, 63)), [5, 6], [7, 8, 9]]  # 95 slots at the end, 180 if prefilled together
    results = decoder.generate(prompts, max_new_tokens=10, ignore_eos=True)
    assert [len(r.token_ids) for r in results] == [10, 10, 10]
    alone = [decoder.generate([p], max_new_tokens=10, ignore_eos=True)[0].token_ids for p in prompts]
    assert [r.token_ids for r in results] == alone
    assert_pools_empty(decoder)
