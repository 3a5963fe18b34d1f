"""What a captured rejection round or SMC cycle (`hsmc.engine.round_graphs.RoundGraphs`) relies on, checked on
the CPU.

A CUDA graph replays a round's kernels but not its Python: the host ints the round's code changes must be
declared by the levels (`graph_parts`) so a replay can advance them, and a round of one shape must move them
by the same amount every time. Both are checked here on every round of real runs, over the stacks whose top
rejection level gets graphed rounds on CUDA, and on every SMC cycle of the SMC stacks. When a shape is
captured, and that rounds inside a graphed round run eagerly, is checked with the capture stubbed.
(Capture and replay need a GPU: tests/gpu/test_stacks_on_cuda.py and test_smc_stacks_on_cuda.py compare them with
the CPU and with eager rounds and cycles.)
"""

from __future__ import annotations

import pytest
import torch
from test_host_reads import PROMPTS, models, smc_models, stack_levels  # noqa: F401  (module fixtures)

from hsmc.decoder import HierarchicalDecoder
from hsmc.engine.round_graphs import GraphParts, HostField, RoundGraphs
from hsmc.engine.timer import ForwardTimer
from hsmc.levels.rejection import RejectionLevel

STACKS = {
    "model-smc": ["model:draft", "smc:target"],
    "model-rejection": ["model:draft", "rejection:target"],
    "eagle3-rejection": ["eagle3:head", "rejection:draft"],
    "model-rejection-rejection": ["model:draft", "rejection:draft2", "rejection:target"],
    "eagle3-rejection-smc": ["eagle3:head", "rejection:draft", "smc:target"],
    "model-rejection-smc": ["model:draft", "rejection:draft2", "smc:target"],
}


def _host_ints(level) -> dict[tuple[int, str], tuple[object, int]]:
    """Every int attribute of every hsmc object reachable from `level` (timers aside: a round pauses them)."""
    found, stack, seen = {}, [level], set()
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, ForwardTimer):
            continue
        seen.add(id(obj))
        for name, value in vars(obj).items():
            if type(value) is int:
                found[(id(obj), name)] = (obj, value)
            elif type(value).__module__.startswith("hsmc.") and hasattr(value, "__dict__"):
                stack.append(value)
    return found


def _watch(owner, method: str, fields: list[HostField], key_of) -> dict[str, int]:
    """Wrap `owner.<method>` (a round) so every call checks that it changes no undeclared host int under `owner`
    and that calls of one key (`key_of(*args)` + the key fields) move the declared ones by the same amount."""
    declared = {(id(f.owner), f.name) for f in fields}
    deltas: dict[tuple, tuple[int, ...]] = {}
    seen = {"rounds": 0, "repeats": 0, "moved": 0}
    plain = getattr(owner, method)

    def watched(*args):
        before_all, before = _host_ints(owner), [getattr(f.owner, f.name) for f in fields]
        out = plain(*args)
        after_all, after = _host_ints(owner), [getattr(f.owner, f.name) for f in fields]
        changed = {k for k, (_, v) in before_all.items() if after_all[k][1] != v}
        undeclared = [f"{type(before_all[k][0]).__name__}.{k[1]}" for k in changed - declared]
        assert not undeclared, f"a round changed host ints no level declares: {undeclared}"
        key = (key_of(*args), tuple(v for f, v in zip(fields, before) if f.role == "key"))
        delta = tuple(a - b for a, b in zip(after, before))
        seen["repeats"] += key in deltas
        seen["moved"] += any(delta)
        assert deltas.setdefault(key, delta) == delta, f"rounds of one shape moved the host ints differently: {key}"
        seen["rounds"] += 1
        return out

    setattr(owner, method, watched)
    return seen


def _decoder(name: str, tiny: dict) -> HierarchicalDecoder:
    levels = stack_levels(STACKS[name], tiny, gamma=3)
    if levels[-1]["kind"] == "smc":
        levels[-1].update(particles=4, block_size=5)
    return HierarchicalDecoder.from_config({"levels": levels, "engine": {"kv_capacity_tokens": 8192}})


def _decode(decoder: HierarchicalDecoder) -> None:
    decoder.generate(PROMPTS, max_new_tokens=30, ignore_eos=True)
    decoder.generate(PROMPTS[:1], max_new_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("name", [n for n in STACKS if "rejection" in n])
def test_rounds_move_only_declared_host_ints_by_a_fixed_amount_per_shape(smc_models, name):  # noqa: F811
    decoder = _decoder(name, smc_models)
    graphed = [
        lv
        for lv, above in zip(decoder.stack.levels, decoder.stack.levels[1:] + [None])
        if isinstance(lv, RejectionLevel) and not isinstance(above, RejectionLevel)
    ]
    assert len(graphed) == 1
    level = graphed[0]
    seen = _watch(level, "_round", level.graph_parts().host, lambda rows, active=None: (len(rows), active is None))
    _decode(decoder)
    assert seen["rounds"] > 10 and seen["repeats"] > seen["rounds"] // 2 and seen["moved"]


@pytest.mark.parametrize("name", [n for n in STACKS if n.endswith("smc")])
def test_smc_cycles_move_only_declared_host_ints_by_a_fixed_amount_per_shape(smc_models, name):  # noqa: F811
    """The unit a graphed SMC cycle captures (resampling and forks, the proposal or block fill, the verify, the
    ends and weights) over every level below: the fill's planned rounds are a key, its counts advance."""
    decoder = _decoder(name, smc_models)
    top = decoder.stack.top
    fields = top.graph_parts().host
    seen = _watch(top, "_decided_cycle", fields, lambda rows, slots, *rest: (len(rows), len(slots)))
    _decode(decoder)
    assert seen["rounds"] >= 8 and seen["repeats"] >= 3 and seen["moved"]
    if "rejection" in name:
        assert {"planned", "blocks", "rounds_run"} <= {f.name for f in fields}


class _Counter:
    def __init__(self) -> None:
        self.length, self.pending = 0, 1


def test_a_shape_is_captured_once_it_makes_half_of_the_last_rounds_and_deltas_must_agree(monkeypatch):
    """The capture decision, without a GPU (`_capture` recorded instead of run): shapes of a few rounds each (rows
    finishing one by one) stay eager; a shape in every other round (a block fill's pattern) is captured at its 8th
    round among the last 16, with the context bucket covering the lengths after the round; a round whose host
    ints move differently from earlier rounds of its shape is an error naming both moves."""
    state = _Counter()
    grow = {"by": 3}

    def round_fn(rows):
        state.length += grow["by"]
        return rows + 1

    parts = GraphParts(host=[HostField(state, "length", "length"), HostField(state, "pending")])
    graphs = RoundGraphs(round_fn, parts, context_buckets=[16, 64, 256])
    captures = []

    def fake_capture(key, inputs, before, after, context):
        captures.append((len(inputs[0]), before, after, context))
        return round_fn(*inputs)

    monkeypatch.setattr(graphs, "_capture", fake_capture)
    rows = {n: torch.zeros(n, dtype=torch.int64) for n in range(1, 17)}
    for n in range(16, 0, -1):  # a batch ending: every shape for 5 rounds
        for _ in range(5):
            graphs(rows[n])
    assert captures == []
    state.length = 0
    for _ in range(7):  # alternating two shapes not among the last 16: 7 rounds each are not yet enough
        graphs(rows[9])
        graphs(rows[10])
    assert captures == []
    graphs(rows[9])
    assert len(captures) == 1
    n, before, after, context = captures[0]
    assert n == 9 and after == (before[0] + 3, 1) and context == 64 and before[0] + 3 > 16
    grow["by"] = 5
    with pytest.raises(RuntimeError, match=r"\(5, 0\) and \(3, 0\)"):
        graphs(rows[5])  # eager (5 rounds long ago): its move is checked
    grow["by"] = 3
    graphs.frozen = True  # after a warmup: a shape seen often enough still runs eagerly, never captured
    for _ in range(20):
        graphs(rows[11])
    assert len(captures) == 1


def test_rounds_inside_a_round_being_captured_run_eagerly(monkeypatch):
    """A block fill's rejection rounds inside an SMC cycle: while the outer round is captured the inner graphs
    neither replay nor capture nor count shapes; while it runs eagerly they work as they would alone."""
    state = _Counter()

    def inner_fn(rows):
        state.length += 1
        return rows + 1

    length = [HostField(state, "length", "length")]
    inner = RoundGraphs(inner_fn, GraphParts(host=length), [64])
    outer = RoundGraphs(lambda rows: inner(inner(rows)), GraphParts(host=length, graphs=[inner]), [64])
    captured = []

    def fake_capture(graphs, key, inputs, before, after, context):  # the capture's runs, without a GPU
        captured.append(graphs)
        with graphs._inside(context):
            return graphs.round_fn(*inputs)

    for graphs in (inner, outer):
        monkeypatch.setattr(graphs, "_capture", lambda *args, g=graphs: fake_capture(g, *args))
    outer.capture_after = 4
    rows = torch.zeros(3, dtype=torch.int64)
    for _ in range(3):
        assert (outer(rows) == 2).all()
    assert captured == [] and len(inner.recent) == 6  # eager outer rounds: the inner ones count as usual
    assert (outer(rows) == 2).all()
    assert captured == [outer] and len(inner.recent) == 6 and not inner.inside_outer  # captured: inner untouched
    for _ in range(2):
        inner(rows)
    assert captured == [outer, inner]
