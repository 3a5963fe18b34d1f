"""Any level over any level it can consume: stacks of every depth, with prompts of one token or more."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import TINY_CONFIGS, make_tiny_model
from helpers import assert_pools_empty
from test_eagle_checkpoint import published_layout
from test_rejection import _hf_greedy
from test_smc_level import _normalised, _sampling_floor, _token_logps, _tv

from hsmc.decoder import HierarchicalDecoder
from hsmc.errors import ConfigError

LLAMA = TINY_CONFIGS["llama"]
SIZES = (LLAMA["hidden_size"], LLAMA["num_attention_heads"], LLAMA["num_key_value_heads"], 16, 96)
PROMPTS = [[3], [60], [5, 9, 13], [8]]  # one-token prompts next to a longer one


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """small (the head's verifier), mid and big: different random models sharing a vocabulary; a random
    EAGLE3 head for small."""
    root = tmp_path_factory.mktemp("family")
    small = make_tiny_model("llama", root / "small", seed=11)
    mid = make_tiny_model("llama", root / "mid", seed=12)
    big = make_tiny_model("llama", root / "big", seed=13)
    head, _ = published_layout(root / "head", dtype=torch.float32, sizes=(*SIZES, 101, 40), scale=0.3)
    return {"small": small, "mid": mid, "big": big, "head": head}


def _levels(family, spec: str, temperature: float) -> list[dict]:
    """`spec` like "eagle3 rejection:small rejection:big": the bottom drafts for the level above it."""
    levels = []
    for part in spec.split():
        kind, _, model = part.partition(":")
        if kind == "eagle3":
            levels.append({"kind": kind, "model": str(family["head"]), "temperature": temperature})
        else:
            levels.append({"kind": kind, "model": str(family[model]), "temperature": temperature})
        if kind == "rejection":
            levels[-1]["num_draft_tokens"] = 3
    return levels


LOSSLESS = [
    "model:big",
    "model:small rejection:big",
    "model:small rejection:mid rejection:big",
    "eagle3 rejection:small",
    "eagle3 rejection:small rejection:mid rejection:big",
]


@pytest.mark.parametrize("spec", LOSSLESS)
def test_one_token_prompts_decode_greedily_in_every_lossless_stack(family, spec):
    decoder = HierarchicalDecoder.from_config(
        {"levels": _levels(family, spec, 0.0), "engine": {"kv_capacity_tokens": 4096}}
    )
    top = family[spec.split()[-1].partition(":")[2]]
    results = decoder.generate(PROMPTS, max_new_tokens=12)
    for prompt, result in zip(PROMPTS, results):
        assert result.token_ids == _hf_greedy(top, prompt, 12, ignore_eos=False), prompt
    assert_pools_empty(decoder)


@pytest.mark.parametrize(
    "spec",
    [
        "model:big smc:big",
        "model:small rejection:big smc:big",
        "eagle3 rejection:big smc:big",
        "eagle3 rejection:small rejection:mid rejection:big smc:big",
    ],
)
def test_one_token_prompts_under_smc_are_weighed_exactly(family, spec):
    """The proposal below smc guarantees the target's own distribution (alpha = 1): every weight must stay 0,
    so each token's log q reported up the stack (also for the first tokens of one-token prompts) is exact."""
    levels = _levels(family, spec, 1.0)
    levels[-1].update(particles=3, block_size=3)
    decoder = HierarchicalDecoder.from_config({"levels": levels, "engine": {"kv_capacity_tokens": 4096}})
    results = decoder.generate(PROMPTS, max_new_tokens=10, ignore_eos=True, seed=4)
    for result in results:
        assert len(result.token_ids) == 10
        assert max(abs(p.log_weight) for p in result.smc.particles) < 1e-3
        assert abs(result.smc.log_z) < 1e-3  # Σ p = 1
    assert_pools_empty(decoder)


VOCAB = 6


@pytest.fixture(scope="module")
def small_family(tmp_path_factory):
    """An enumerable depth-4 stack: head → small → mid → smc over big, vocabulary 6 (the head drafts 4 of them)."""
    root = tmp_path_factory.mktemp("small-family")
    models = {
        name: make_tiny_model("llama", root / name, seed=seed, vocab_size=VOCAB, eos_token_id=5)
        for name, seed in (("small", 21), ("mid", 22), ("big", 23))
    }
    models["head"], _ = published_layout(root / "head", dtype=torch.float32, sizes=(*SIZES, 6, 4), scale=0.5, seed=9)
    return models


def test_depth_four_stack_with_smc_converges_and_leaks_nothing(small_family):
    """[eagle3, rejection small, rejection mid, smc big] at alpha = 2: the mid level's exact samples are the
    proposal; TV to the exact normalised p_big^2 falls with N, and every pool is empty after runs that resample."""
    prompt, n_tokens, samples, alpha = [1, 4, 2], 3, 3000, 2.0
    scores = {s: alpha * sum(lp) for s, lp in _token_logps(small_family["big"], prompt, n_tokens).items()}
    exact = _normalised(scores)
    tv = []
    for n in (1, 4, 16):
        levels = _levels(small_family, "eagle3 rejection:small rejection:mid smc:big", 1.0)
        levels[1]["num_draft_tokens"], levels[2]["num_draft_tokens"] = 2, 2
        levels[-1].update(particles=n, block_size=1, alpha=alpha, ess_threshold=0.5)
        decoder = HierarchicalDecoder.from_config(
            {"levels": levels, "engine": {"kv_capacity_tokens": 16384, "max_batch_rows": 1024}}
        )
        results = decoder.generate([prompt] * samples, max_new_tokens=n_tokens, ignore_eos=True, seed=n)
        tv.append(_tv(results, exact))
        assert_pools_empty(decoder)
    print(f"depth 4: TV for N = 1, 4, 16: {tv}; sampling floor {_sampling_floor(exact, samples):.3f}")
    assert tv[0] > tv[1] > tv[2], f"TV for N = 1, 4, 16: {tv}"
    # resampling is decided before a cycle: x0 and one cycle make 3 tokens, longer outputs resample
    results = decoder.generate([prompt] * 16, max_new_tokens=9, ignore_eos=True, seed=1)
    assert sum(r.smc.resamplings for r in results) > 0
    assert_pools_empty(decoder)


def test_eagle3_head_directly_under_smc(small_family, tmp_path):
    """A head that drafts over the whole vocabulary is an smc proposal of its own: it reads the smc target's
    features. TV to the exact p_big falls with N; a head drafting part of the vocabulary is refused (q = 0
    where p > 0 would bias the weights)."""
    head, _ = published_layout(tmp_path / "head", dtype=torch.float32, sizes=(*SIZES, 6, 6), scale=0.05, seed=9)
    prompt, n_tokens, samples = [1, 4, 2], 3, 3000
    exact = _normalised({s: sum(lp) for s, lp in _token_logps(small_family["big"], prompt, n_tokens).items()})
    smc = {"kind": "smc", "model": str(small_family["big"]), "temperature": 1.0, "block_size": 2}
    engine = {"kv_capacity_tokens": 16384, "max_batch_rows": 1024}
    tv = []
    for n in (1, 4, 16):
        levels = [{"kind": "eagle3", "model": str(head), "temperature": 1.0}, {**smc, "particles": n}]
        decoder = HierarchicalDecoder.from_config({"levels": levels, "engine": engine})
        results = decoder.generate([prompt] * samples, max_new_tokens=n_tokens, ignore_eos=True, seed=n)
        tv.append(_tv(results, exact))
        assert_pools_empty(decoder)
    print(f"eagle3 under smc: TV for N = 1, 4, 16: {tv}; sampling floor {_sampling_floor(exact, samples):.3f}")
    assert tv[0] > tv[1] > tv[2], f"TV for N = 1, 4, 16: {tv}"
    partial = [{"kind": "eagle3", "model": str(small_family["head"]), "temperature": 1.0}, {**smc, "particles": 2}]
    with pytest.raises(ConfigError, match="drafts 4 of the 6 tokens; an smc proposal must be able to propose"):
        HierarchicalDecoder.from_config({"levels": partial})


def test_eagle3_head_under_smc_reads_the_targets_features(small_family, tmp_path):
    """After each smc cycle the head holds exactly the pairs (target feature, token) of the committed tokens: the
    same state a head reading the same model's features as a rejection verifier builds from scratch. The check runs
    in the request loop's sink, between two reads (a launch, on the CPU already run, follows each)."""
    from hsmc.requests import SamplingParams

    head, _ = published_layout(tmp_path / "head", dtype=torch.float32, sizes=(*SIZES, 6, 6), scale=0.5, seed=9)
    big = str(small_family["big"])
    smc = {"kind": "smc", "model": big, "temperature": 1.0, "particles": 1, "block_size": 2}
    decoder = HierarchicalDecoder.from_config(
        {"levels": [{"kind": "eagle3", "model": str(head), "temperature": 1.0}, smc]}
    )
    eagle, top = decoder.stack.levels
    fresh = HierarchicalDecoder.from_config(
        {"levels": [{"kind": "eagle3", "model": str(head)}, {"kind": "rejection", "model": big}]}
    )
    f_eagle, f_rejection = fresh.stack.levels
    checked, done, ended = [], [], threading.Event()

    def check(increment) -> None:  # one particle: every read settles tokens
        if increment.error is not None or increment.result is not None:
            done.append(increment)
            if len(done) == 2:
                ended.set()
            return
        for row in (0, 1):
            committed = eagle.state.seq[row, : int(eagle.state.seq_len[row])].tolist()
            f_rejection.load_prompts(torch.tensor([row]), [committed])
            f_rejection.prefill(torch.tensor([row]))
            checked.append(torch.allclose(eagle.last_logits[row], f_eagle.last_logits[row], atol=1e-4))
            f_rejection.release(torch.tensor([row]))

    params = [SamplingParams(max_tokens=12, seed=s, ignore_eos=True) for s in (1, 2)]
    decoder.driver.submit([[1, 4, 2], [3]], params, check)
    assert ended.wait(timeout=900), "the two requests did not end"  # a slow machine: no deadline but a hang's
    decoder.driver.quiesce()
    assert len(done) == 2 and all(d.error is None for d in done)
    assert len(checked) >= 8 and all(checked)
    assert_pools_empty(decoder)


CHUNKED = [
    "model:big",
    "model:small rejection:big",
    "eagle3 rejection:small",
    "eagle3 rejection:small rejection:mid rejection:big",
    "model:small smc:big",
    "eagle3 rejection:small smc:big",
]


@pytest.mark.parametrize("spec", CHUNKED)
def test_prompts_prefilled_in_chunks_decode_as_in_one_forward(family, spec, monkeypatch):
    """`engine.prefill_chunk_tokens` splits a prefill into forwards of at most that many tokens (every model and
    the EAGLE3 head); the outputs equal those of one-forward prefills (near-zero temperatures make every draw an
    argmax), and the lossless stacks still give the top model's greedy tokens."""
    from hsmc.engine.runner import ModelRunner

    prompts = [[3], [(7 * i) % 90 + 1 for i in range(23)], [(5 * i) % 80 + 2 for i in range(40)], [8, 9]]
    levels = _levels(family, spec, 1e-4 if "smc" in spec else 0.0)
    for level in levels:
        if level["kind"] == "smc":
            level.update(particles=2, block_size=3)
    widest: list[int] = []
    forward = ModelRunner.forward

    def recording(runner, batch, last_only=False, **inputs):
        widest.append(batch.tokens.numel())
        return forward(runner, batch, last_only, **inputs)

    monkeypatch.setattr(ModelRunner, "forward", recording)

    def run(engine: dict) -> tuple[list[list[int]], int, list]:
        widest.clear()
        decoder = HierarchicalDecoder.from_config({"levels": levels, "engine": {"kv_capacity_tokens": 4096, **engine}})
        results = decoder.generate(prompts, max_new_tokens=10)
        assert_pools_empty(decoder)
        accepted = [level.get("mean_accepted_length") for level in results[0].stats["levels"]]
        return [r.token_ids for r in results], max(widest), accepted

    whole, whole_widest, whole_accepted = run({})
    chunked, chunked_widest, chunked_accepted = run({"prefill_chunk_tokens": 40})  # 4 rows: 10 per row and chunk
    assert chunked == whole
    assert chunked_accepted == whole_accepted  # the same drafts: the head read the same prompt features
    assert whole_widest >= 3 * 39 and chunked_widest <= 40  # no step of these stacks is wider (8 rows x 4)
    if "smc" not in spec:
        top = family[spec.split()[-1].partition(":")[2]]
        assert whole == [_hf_greedy(top, p, 10, ignore_eos=False) for p in prompts]
