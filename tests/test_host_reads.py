"""Host reads in the decode loop, counted on the CPU: what would be a device->host sync on a GPU.

A TorchDispatchMode sees every aten op; the ones that produce a data-dependent shape (`nonzero`,
`masked_select`, boolean-mask indexing) or hand a value to Python (`_local_scalar_dense`) are counted,
and so are the Tensor methods that convert to Python (`tolist`, `item`, `bool(t)`, `int(t)`, ...). The reads of a run
that do not depend on its length (admission, prefill, final statistics) cancel out by taking the
difference of two runs that differ only in the number of steps.
"""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import make_tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from hsmc.decoder import HierarchicalDecoder

aten = torch.ops.aten
SYNCING = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default}


def _is_boolean_index(func, args) -> bool:
    if func not in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
        return False
    return any(i is not None and i.dtype == torch.bool for i in args[1])


class HostReadCounter(TorchDispatchMode):
    """Counts host reads; the Python conversions are counted where they are called, because under
    `torch.inference_mode` their `_local_scalar_dense` never reaches a dispatch mode."""

    CONVERSIONS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__")

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self._converting = False
        self._thread = threading.get_ident()  # the Tensor methods are patched for every thread: count this one's
        self._methods = {name: getattr(torch.Tensor, name) for name in self.CONVERSIONS}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._converting and (func in SYNCING or _is_boolean_index(func, args)):
            self.count += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self._thread = threading.get_ident()
        for name, method in self._methods.items():
            setattr(torch.Tensor, name, self._counted(method))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, method in self._methods.items():
            setattr(torch.Tensor, name, method)
        return super().__exit__(*exc)

    def _counted(self, method):
        def counted(tensor, *args):
            if self._converting or threading.get_ident() != self._thread:
                return method(tensor, *args)
            self.count += 1
            self._converting = True
            try:
                return method(tensor, *args)
            finally:
                self._converting = False

        return counted


def counted_generate(decoder: HierarchicalDecoder, prompts, **overrides) -> int:
    """Host reads of the decode loop during one generate(): the counter runs on the loop's own thread (a dispatch
    mode is per thread), around each of its iterations."""
    counter = HostReadCounter()
    driver = decoder.driver
    iterate = driver._iterate

    def counted() -> None:
        with counter:
            iterate()

    driver._iterate = counted
    try:
        decoder.generate(prompts, **overrides)
        driver.quiesce()  # the launch the loop ran past the last request's end is read too
    finally:
        del driver._iterate
    return counter.count


def reads_and_steps(decoder: HierarchicalDecoder, prompts, new_tokens: int) -> tuple[int, int]:
    """Host reads during generate(), and how many decode steps the top level ran."""
    top = decoder.stack.top
    steps = 0
    step = top.step

    def counted_step(rows):
        nonlocal steps
        steps += 1
        return step(rows)

    top.step = counted_step
    try:
        reads = counted_generate(decoder, prompts, max_new_tokens=new_tokens, ignore_eos=True)
    finally:
        del top.step
    return reads, steps


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("reads")
    return make_tiny_model("llama", root / "draft", seed=1), make_tiny_model("llama", root / "target", seed=2)


PROMPTS = [[5, 9, 13], [7] * 9, [40, 41, 42, 43]]


def test_model_top_reads_once_per_decode_step(models):
    _, target = models
    decoder = HierarchicalDecoder.from_config({"levels": [{"model": str(target), "temperature": 0.8}]})
    short_reads, short_steps = reads_and_steps(decoder, PROMPTS, 6)
    long_reads, long_steps = reads_and_steps(decoder, PROMPTS, 20)
    assert long_steps - short_steps == 14
    assert long_reads - short_reads <= long_steps - short_steps


@pytest.mark.parametrize(
    "draft_t,variant",
    [(0.0, "chain"), (0.8, "chain"), (0.8, "hierarchy"), (0.8, "tree")],
    ids=["greedy-drafts", "sampled-drafts", "over-rejection", "draft-aware-tree"],
)
def test_rejection_top_reads_once_per_verify_cycle(models, draft_t, variant):
    """Also for a rejection level drafting from another: the lower one runs a host-known number of cycles; and
    for a draft tree (grown, verified and its path kept on the device)."""
    draft, target = models
    levels = [
        {"kind": "model", "model": str(draft), "temperature": draft_t},
        {"kind": "rejection", "model": str(target), "temperature": 0.8, "num_draft_tokens": 3},
    ]
    if variant == "hierarchy":
        levels.insert(1, {"kind": "rejection", "model": str(draft), "temperature": 0.9, "num_draft_tokens": 2})
    if variant == "tree":
        levels[1].update(tree={"depth": 3, "topk": 2, "budget": 5}, tree_rule="draft_aware")
    decoder = HierarchicalDecoder.from_config({"levels": levels})
    short_reads, short_steps = reads_and_steps(decoder, PROMPTS, 6)
    long_reads, long_steps = reads_and_steps(decoder, PROMPTS, 30)
    assert long_steps > short_steps
    assert long_reads - short_reads <= long_steps - short_steps


def test_verifier_forwards_follow_the_slowest_row_not_the_sum(models):
    """Rows that accept different numbers of drafts stay in one verify forward per cycle: B prompts cost
    as many verifier forwards as the slowest row needs cycles (+1: the step the overlapped driver has
    already started when it reads that the last row finished)."""
    draft, target = models
    levels = [
        {"kind": "model", "model": str(draft), "temperature": 0.0},
        {"kind": "rejection", "model": str(target), "temperature": 0.0, "num_draft_tokens": 4},
    ]
    decoder = HierarchicalDecoder.from_config({"levels": levels})
    verifier = decoder.stack.top.state.runner
    forwards = 0
    forward = verifier.forward

    def counted(*args, **kwargs):
        nonlocal forwards
        forwards += 1
        return forward(*args, **kwargs)

    verifier.forward = counted
    prompts = PROMPTS + [[11, 12], [60] * 5, [3, 1, 4, 1, 5]]
    alone = []
    for p in prompts:  # cycles each row needs on its own (prefill excluded)
        forwards = 0
        decoder.generate([p], max_new_tokens=24, ignore_eos=True)
        alone.append(forwards - 1 - 1)
    forwards = 0
    together = decoder.generate(prompts, max_new_tokens=24, ignore_eos=True)
    assert len(set(alone)) > 1, "rows should need different numbers of cycles (ragged acceptance)"
    assert forwards - 1 - 1 == max(alone)
    singles = [decoder.generate([p], max_new_tokens=24, ignore_eos=True)[0].token_ids for p in prompts]
    assert [r.token_ids for r in together] == singles


SMC = {"kind": "smc", "temperature": 1.0, "particles": 4, "block_size": 3, "ess_threshold": 0.9}
SMC_STACKS = {
    "model-smc": ["model:draft"],
    "model-rejection-smc": ["model:draft", "rejection:draft2"],
    "model-tree-rejection-smc": ["model:draft", "tree:draft2"],
    "model-rejection-rejection-smc": ["model:draft", "rejection:draft2", "rejection:draft"],
    "eagle3-rejection-smc": ["eagle3:head", "rejection:draft"],
    "eagle3-smc": ["eagle3:head"],
    "model-smc-stop-string": ["model:draft"],
}
SETUP_READS = 4  # outside the cycles: the x0 step, the read after the last cycle (stop strings), statistics


@pytest.fixture(scope="module")
def smc_models(tmp_path_factory, models):
    """The two models above with a tokenizer (stop strings need text), a third model, and an EAGLE3 head over
    the full vocabulary (it may draft directly for an smc level)."""
    from conftest import TINY_CONFIGS, save_tokenizer
    from test_eagle_checkpoint import published_layout

    root = tmp_path_factory.mktemp("smc-reads")
    draft, target = models
    vocab = [chr(ord("a") + i % 26) * (1 + i // 26) for i in range(TINY_CONFIGS["llama"]["vocab_size"])]
    for folder in models:
        save_tokenizer(folder, vocab)
    llama = TINY_CONFIGS["llama"]
    sizes = (llama["hidden_size"], llama["num_attention_heads"], llama["num_key_value_heads"], 16, 96, 101, 101)
    head, _ = published_layout(root / "head", dtype=torch.float32, sizes=sizes, scale=0.3)
    draft2 = make_tiny_model("llama", root / "draft2", seed=3)
    save_tokenizer(draft2, vocab)
    return {"draft": draft, "draft2": draft2, "target": target, "head": head}


def stack_levels(parts: list[str], models: dict, gamma: int) -> list[dict]:
    """Level configs from "kind:model" parts at T = 1; rejection levels draft `gamma` tokens ("tree": a rejection
    level drafting draft-aware trees of depth `gamma`)."""
    levels = []
    for part in parts:
        kind, model = part.split(":")
        levels.append({"kind": kind, "model": str(models[model]), "temperature": 1.0})
        if kind == "rejection":
            levels[-1]["num_draft_tokens"] = gamma
        if kind == "tree":
            tree = {"depth": gamma, "topk": 2, "budget": 2 * gamma}
            levels[-1].update(kind="rejection", tree=tree, tree_rule="draft_aware")
    return levels


@pytest.mark.parametrize("name", list(SMC_STACKS))
def test_smc_top_reads_once_per_cycle(smc_models, name):
    """Every SMC stack reads the device once per SMC cycle (the packed result copy), whatever levels sit
    below, resampling included; a constant number of reads outside the cycles (SETUP_READS)."""
    levels = [*stack_levels(SMC_STACKS[name], smc_models, gamma=2), {**SMC, "model": str(smc_models["target"])}]
    decoder = HierarchicalDecoder.from_config({"levels": levels, "engine": {"kv_capacity_tokens": 8192}})
    stop = ["bb"] if name.endswith("stop-string") else []
    top = decoder.stack.top
    counts = []
    for new_tokens in (9, 41):
        reads = counted_generate(decoder, PROMPTS, max_new_tokens=new_tokens, ignore_eos=True, stop=stop)
        counts.append((reads, top.cycles, top.resamples))
    (short_reads, short_cycles, _), (long_reads, long_cycles, long_resamples) = counts
    print(f"{name}: {long_reads} reads in {long_cycles} cycles, {short_reads} in {short_cycles}")
    assert long_cycles > short_cycles and long_resamples > 0
    assert long_reads - short_reads <= long_cycles - short_cycles
    assert long_reads <= long_cycles + SETUP_READS and short_reads <= short_cycles + SETUP_READS
