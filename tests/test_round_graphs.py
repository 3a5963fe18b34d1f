"""What a graphed unit (`hsmc.engine.graphs.Graphs`: a forward, a rejection round, an SMC cycle) relies on, checked
on the CPU.

A CUDA graph replays a unit's kernels but not its Python: the host ints a round's code changes must be declared by
the levels (`graph_parts`) so a replay can advance them, and a round of one shape must move them by the same
amount every time. Both are checked here on every round of real runs, over the stacks whose top rejection level
gets graphed rounds on CUDA, and on every SMC cycle of the SMC stacks. When a shape is captured, that units
inside a unit being captured run as plain code, how a forward's rows are padded to buckets, and that a warmup
captures every cycle shape real traffic meets are checked with the capture emulated: an emulated graph replays by
running the unit eagerly, inside a capture scope as a real replay's kernels would. (Real capture and replay:
`tests/gpu/`.)
"""

from __future__ import annotations

import pytest
import torch
from test_host_reads import PROMPTS, models, smc_models, stack_levels  # noqa: F401  (module fixtures)

from hsmc.decoder import HierarchicalDecoder
from hsmc.engine.graphs import CAPTURE_AFTER, Graphs, GraphScope, HostField, _Captured
from hsmc.engine.timer import ForwardTimer
from hsmc.levels.block_fill import geometric_yield_law
from hsmc.levels.rejection import RejectionLevel
from hsmc.requests import SamplingParams

STACKS = {
    "model": ["model:target"],
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


def _decoder(name: str, tiny: dict, **engine) -> HierarchicalDecoder:
    levels = stack_levels(STACKS[name], tiny, gamma=3)
    if levels[-1]["kind"] == "smc":
        levels[-1].update(particles=4, block_size=5)
    return HierarchicalDecoder.from_config({"levels": levels, "engine": {"kv_capacity_tokens": 8192, **engine}})


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


def test_a_model_tops_steps_move_only_declared_host_ints_and_replay_their_eager_tokens(smc_models, monkeypatch):  # noqa: F811
    """A `model` top's step (forward, sampling, bookkeeping) is one graphed unit on CUDA, as a round of γ = 0 is:
    it changes only the host ints its level declares, by the same amount per shape, and (captures emulated) seeded
    T = 1 requests decode the same tokens through replayed steps as eagerly, batch sizes changing as they end."""
    decoder = _decoder("model", smc_models)
    level = decoder.stack.top
    seen = _watch(level, "_sampled", level.graph_parts().host, lambda rows: len(rows))
    _decode(decoder)
    assert seen["rounds"] > 10 and seen["repeats"] > seen["rounds"] // 2 and seen["moved"]

    decoder = _decoder("model", smc_models)
    level, scope = decoder.stack.top, decoder.stack.scope
    lengths = [60, 44, 25]  # rows end at different steps: 3, then 2, then 1 row (three shapes)
    runs = [decoder.generate(PROMPTS, params=[SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths], seed=3)]
    monkeypatch.setattr(Graphs, "_capture", _emulated_capture)
    level.steps = Graphs(level._sampled, scope, level.graph_parts().host, level.state.timer.whole)
    runs.append(
        decoder.generate(PROMPTS, params=[SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths], seed=3)
    )
    assert [r.token_ids for r in runs[0]] == [r.token_ids for r in runs[1]]
    # each shape replays from its CAPTURE_AFTER-th run on
    assert level.steps.replays >= max(lengths) - 3 * CAPTURE_AFTER
    assert runs[1][0].stats["levels"][0]["graphed_steps"] == level.steps.replays


class _Counter:
    def __init__(self) -> None:
        self.length, self.pending = 0, 1


def test_a_shape_is_captured_once_it_makes_half_of_the_last_rounds_and_deltas_must_agree(monkeypatch):
    """The capture decision (`_capture` recorded instead of run): shapes of a few rounds each (rows finishing one by
    one) stay eager; a shape in every other round (a block fill's pattern) is captured at its 8th round among the
    last 16, with the context bucket covering the lengths after the round; a round whose host ints move differently
    from earlier rounds of its shape is an error naming both moves; with capturing off (after a warmup) a shape
    seen often enough still runs eagerly, counted as missed."""
    state = _Counter()
    grow = {"by": 3}

    def round_fn(rows):
        state.length += grow["by"]
        return rows + 1

    scope = GraphScope([16, 64, 256])
    graphs = Graphs(round_fn, scope, [HostField(state, "length", "length"), HostField(state, "pending")])
    captures = []

    def fake_capture(key, static, before, after, context, options):
        captures.append((len(static[0]), before, after, context))
        return round_fn(*static)

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
    scope.capturing = "none"
    for _ in range(20):
        graphs(rows[11])
    assert len(captures) == 1 and graphs.missed == 20


def _emulated_capture(self, key, static, before, after, context, options):
    """`Graphs._capture` on the CPU: the eager run with the bucket's plans, and a graph whose replay runs the unit
    again inside a capture scope (units inside run as plain code, forwards planned for the bucket)."""
    with self.scope.planned(context):
        outputs = self.run(*static, **options)
    like = outputs if isinstance(outputs, tuple) else (outputs,)
    static_outputs = tuple(o.clone() if isinstance(o, torch.Tensor) else o for o in like)

    class Replayer:
        def replay(self_) -> None:
            with self.scope.planned(context):
                again = self.run(*static, **options)
            for out, new in zip(static_outputs, again if isinstance(again, tuple) else (again,)):
                if isinstance(out, torch.Tensor):
                    out.copy_(new)

    kept = static_outputs if isinstance(outputs, tuple) else static_outputs[0]
    self.captured[key] = _Captured(Replayer(), static, kept)
    return outputs


def test_units_inside_a_unit_being_captured_run_as_plain_code(monkeypatch):
    """A block fill's rejection rounds inside an SMC cycle: while the outer unit is captured (its eager run with the
    bucket's plans included) the inner one neither replays nor captures nor counts shapes; while it runs eagerly the
    inner one works as it would alone; the scope says no capture is in progress afterwards."""
    state = _Counter()

    def inner_fn(rows):
        state.length += 1
        return rows + 1

    scope = GraphScope([64])
    length = [HostField(state, "length", "length")]
    inner = Graphs(inner_fn, scope, length)
    outer = Graphs(lambda rows: inner(inner(rows)), scope, length)
    captured = []

    def fake_capture(self, *args):
        captured.append(self)
        return _emulated_capture(self, *args)

    monkeypatch.setattr(Graphs, "_capture", fake_capture)
    outer.capture_after = 4
    rows = torch.zeros(3, dtype=torch.int64)
    for _ in range(3):
        assert (outer(rows) == 2).all()
    assert captured == [] and len(inner.recent) == 6  # eager outer rounds: the inner ones count as usual
    assert (outer(rows) == 2).all()
    assert captured == [outer] and len(inner.recent) == 6 and scope.bucket is None  # inner untouched
    assert (outer(rows) == 2).all() and outer.replays == 1 and len(inner.recent) == 6
    for _ in range(2):
        inner(rows)
    assert captured == [outer, inner]


def test_a_cycle_is_keyed_by_the_shape_of_every_input(monkeypatch):
    """A cycle's inputs differ in length (rows, group slots, stop ids): as many rows in other groups are another
    shape, with a graph of its own, and each replays what it computes."""
    monkeypatch.setattr(Graphs, "_capture", _emulated_capture)
    scope = GraphScope([64])
    scope.capturing = "every"
    unit = Graphs(lambda rows, slots: rows.sum() + 10 * slots.sum(), scope)
    rows = torch.arange(4)
    assert unit(rows, torch.tensor([1])) == 16 and unit(rows, torch.tensor([1, 2])) == 36
    assert len(unit.captured) == 2 and unit.replays == 0
    assert unit(rows, torch.tensor([2])) == 26 and unit(rows + 1, torch.tensor([0, 1])) == 20 and unit.replays == 2


def test_a_forward_captures_every_rows_and_context_bucket_at_its_second_use_and_pads_its_rows(monkeypatch):
    """A forward unit (rows padded to a bucket, no host ints): a width run once stays eager (a drafter catching up
    after rounds without drafts runs a width seen once; capturing its buckets cost 78 ms on an H200). Its second run
    in the window captures it at every rows × context bucket from padding alone; a replay copies the rows in, sets
    the padding rows to their pads and hands back the real rows' outputs, equal to an eager run; longer contexts
    take a larger bucket."""
    monkeypatch.setattr(Graphs, "_capture", _emulated_capture)
    scope = GraphScope([512, 2048])
    seen = []

    def forward(rows, tokens):
        seen.append((len(rows), scope.bucket))
        return (tokens * 2 + rows[:, None],)

    unit = Graphs(forward, scope, row_buckets=[1, 2, 4, 8], pads=(8, None))
    rows, tokens = torch.tensor([3, 1, 4]), torch.tensor([[5], [6], [7]])
    unit(rows, torch.tensor([[5, 0, 1], [6, 0, 1], [7, 0, 1]]), longest=100)  # a catch-up width, once
    assert not unit.captured and seen == [(3, 512)]
    (out,) = unit(rows, tokens, longest=100)
    assert torch.equal(out, tokens * 2 + rows[:, None]) and not unit.captured, "a width's first run is eager"
    (out,) = unit(rows, tokens, longest=100)
    assert torch.equal(out, tokens * 2 + rows[:, None])
    assert len(unit.captured) == 8 and seen[2:4] == [(8, 2048), (8, 512)]  # largest first
    static = next(
        c.inputs for (shape, context), c in unit.captured.items() if shape[0][0][0] == (4,) and context == 512
    )
    assert static[0].tolist() == [3, 1, 4, 8]  # the padding row points at the scratch row
    (out,) = unit(rows[:2], tokens[:2], longest=600)
    assert torch.equal(out, tokens[:2] * 2 + rows[:2, None]) and seen[-1] == (2, 2048)
    assert unit.replays == 2 and len(unit.captured) == 8


def test_warmup_captures_every_cycle_shape_that_real_traffic_meets(smc_models, monkeypatch):  # noqa: F811
    """Issue 29 §4: under a block fill an SMC cycle's graph is keyed by the rounds R planned from the measured
    acceptance law, and real traffic's law is not the warmup's. After `warmup()` (units and captures as on CUDA,
    emulated), requests whose laws plan every R a block may take run no cycle without a graph."""
    decoder = _decoder("eagle3-rejection-smc", smc_models, max_batch_rows=8)
    stack, scope = decoder.stack, decoder.stack.scope
    rejection, top = stack.levels[1], stack.top
    rejection.rounds = Graphs(rejection._kept, scope, rejection.graph_parts().host, rejection.state.timer.whole)
    top.cycle_graphs = Graphs(top._decided_cycle, scope, top.graph_parts().host, top.state.timer.whole)
    monkeypatch.setattr(Graphs, "_capture", _emulated_capture)
    decoder.warmup(progress=False)
    fill = rejection.fill
    assert scope.capturing == "none" and fill.forced is None
    planned = [f.name for f in top.cycle_graphs.host if f.role == "key"].index("planned")
    assert {key[0][2][planned] for key in top.cycle_graphs.captured} == set(fill.choices(5))
    monkeypatch.setattr(fill, "observe", lambda values: None)  # real traffic: the law stays what is set here
    plans = set()
    for mean in (1.0, 1.6, 2.3, 3.1, 4.0):
        fill.law = geometric_yield_law(mean, 3)
        plans.add(fill.planned)
        for n in (1, 2):
            decoder.generate(PROMPTS[:n], max_new_tokens=20, ignore_eos=True)
            assert top.cycle_graphs.replays > 0
    assert len(plans) >= 3 and top.cycle_graphs.missed == 0


def test_engine_modules_import_each_other_without_a_cycle():
    """Every import between `hsmc/engine` modules, those under TYPE_CHECKING included, goes one way (the graph
    mechanism imports no other engine module; the runner, timer and sampler import it)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "hsmc" / "engine"
    imports = {}
    for path in root.glob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hsmc.engine."):
                names.add(node.module.split(".")[2])
            elif isinstance(node, ast.Import):
                names |= {a.name.split(".")[2] for a in node.names if a.name.startswith("hsmc.engine.")}
        imports[path.stem] = names
    assert imports["runner"] >= {"graphs"} and not imports["graphs"]

    def reaches(start: str, seen: tuple[str, ...]) -> None:
        for name in imports.get(start, ()):
            assert name not in seen, f"import cycle: {' -> '.join((*seen, name))}"
            reaches(name, (*seen, name))

    for module in imports:
        reaches(module, (module,))


def test_the_hosts_switch_to_op_by_op_cycles_reaches_a_following_rank(smc_models, monkeypatch):  # noqa: F811
    """`hsmc bench` times a graphed stack's levels from cycles launched op by op. Under tensor parallelism every
    rank must follow that switch (one rank replaying a cycle while another runs it op by op waits forever on the
    GPU), so it travels in the stack's mode; while it is off no cycle replays and the stats claim none."""
    monkeypatch.setattr(Graphs, "_capture", _emulated_capture)
    leader, follower = (_decoder("eagle3-rejection-smc", smc_models, max_batch_rows=8) for _ in range(2))
    top = follower.stack.top
    top.cycle_graphs = Graphs(top._decided_cycle, follower.stack.scope, top.graph_parts().host, top.state.timer.whole)
    follower.warmup(progress=False)
    for replay in (False, True):
        leader.stack.top.replay_cycles = replay
        follower.stack.set_mode(leader.stack.mode)
        assert top.replay_cycles is replay
        (result,) = follower.generate(PROMPTS[:1], max_new_tokens=20, ignore_eos=True)
        graphed = result.stats["levels"][-1].get("graphed_cycles", 0)
        assert (graphed > 0) is replay and (top.cycle_graphs.replays > 0) is replay
