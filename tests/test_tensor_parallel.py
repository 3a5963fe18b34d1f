"""Tensor parallelism on the CPU (gloo): shards load as slices of the checkpoint, a sharded forward gives the
logits of the whole model, and every stack kind decodes through `HierarchicalDecoder` as at TP=1."""

from __future__ import annotations

import json
import socket
import threading

import httpx
import pytest
import torch
import yaml
from conftest import TINY_CONFIGS, make_tiny_model
from helpers import assert_pools_empty, make_runner, run_new_tokens
from test_eagle_checkpoint import published_layout
from test_fp8 import QWEN_FP8_SHAPE, write_qwen_fp8_checkpoint
from test_host_reads import reads_and_steps
from test_serve import configs, live_server, metric, wait_idle  # noqa: F401 (configs: a fixture)
from test_stacks import SIZES

import hsmc.decoder
from hsmc.cli import main
from hsmc.config import load_config
from hsmc.decoder import HierarchicalDecoder
from hsmc.engine.ranks import POOL, ControlChannel, check_world, join, start_ranks
from hsmc.errors import ConfigError, HsmcError, ModelLoadError
from hsmc.models.loading import load_model
from hsmc.models.parallel import TensorParallel
from hsmc.ops.fp8_linear import Fp8Linear
from hsmc.preflight import check_before_loading
from hsmc.serve import create_app

PROMPTS = [[3, 17, 5, 9, 40], [8], [60, 2, 33]]


@pytest.fixture(scope="module", autouse=True)
def no_ranks_left():
    """The ranks the decoders here handed back end with this module, not with the test session."""
    yield
    POOL.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Tiny random models of each architecture whose heads, KV heads and MLP split over 2 ranks (qwen2's one KV
    head made 2), and a Qwen FP8 checkpoint of 128x128 blocks."""
    root = tmp_path_factory.mktemp("tp")
    folders = {
        "llama": make_tiny_model("llama", root / "llama", seed=1),
        "qwen2": make_tiny_model("qwen2", root / "qwen2", seed=2, num_key_value_heads=2),
        "qwen3": make_tiny_model("qwen3", root / "qwen3", seed=3),
    }
    dense = make_tiny_model("qwen3", root / "dense", seed=4, **QWEN_FP8_SHAPE)
    write_qwen_fp8_checkpoint(dense, root / "fp8")
    folders["fp8"] = root / "fp8"
    return {name: str(folder) for name, folder in folders.items()}


def _logits(model) -> list[torch.Tensor]:
    """Logits of PROMPTS, prefilled in one ragged forward and then one token decoded per row."""
    runner = make_runner(model)
    rows = list(range(len(PROMPTS)))
    prefill, _ = run_new_tokens(runner, rows, PROMPTS)
    decode, _ = run_new_tokens(runner, rows, [[7]] * len(PROMPTS))
    return [torch.cat([p, d]) for p, d in zip(prefill, decode)]


def _sharded_logits(ranks, folders: dict[str, str]) -> dict[str, list[torch.Tensor]]:
    return {name: _logits(load_model(folder, tp=ranks.tp).model) for name, folder in folders.items()}


def _logits_follower(rank: int, world_size: int, init_method: str, device: str, folders: dict[str, str]) -> None:
    ranks = join(rank, world_size, init_method, device)
    _sharded_logits(ranks, folders)
    assert ranks.broadcast() is None  # rank 0's stop, as a following rank receives it
    ranks.leave()


@pytest.mark.spawns
def test_sharded_forward_gives_the_whole_models_logits(tiny):
    """Two gloo ranks (this process and a spawned one), each loading its slices: the all-gathered logits of every
    architecture (an FP8 checkpoint too) agree with the unsharded model's within float32 rounding."""
    POOL.close()  # the group decoders of other tests left
    ranks = start_ranks(2, "cpu", _logits_follower, (tiny,))
    try:
        sharded = _sharded_logits(ranks, tiny)
    finally:
        ranks.close()
    for name, folder in tiny.items():
        whole = _logits(load_model(folder).model)
        for a, b in zip(sharded[name], whole):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def test_world_size_one_calls_no_collective(tiny, monkeypatch):
    def collective(*args, **kwargs):
        raise AssertionError("a collective at world size 1")

    for name in ("all_reduce", "all_gather", "broadcast", "broadcast_object_list"):
        monkeypatch.setattr(torch.distributed, name, collective)
    logits = _logits(load_model(tiny["qwen2"]).model)
    assert logits[0].shape == (len(PROMPTS[0]) + 1, 97)


def test_each_rank_reads_its_slices(tiny):
    """Rank r's q/k/v, gate/up rows and o/down columns are the r-th halves of the checkpoint's, the vocabulary
    split in ceil(V/2) rows with zero padding, norms whole; FP8 weights and their scales split block for block."""
    for name in ("qwen2", "fp8"):
        whole = load_model(tiny[name]).model
        shards = [load_model(tiny[name], tp=TensorParallel(r, 2)).model for r in range(2)]
        for key, value in whole.state_dict().items():
            parts = [s.state_dict()[key] for s in shards]
            module = key.rsplit(".", 2)[-2]
            if module in ("embed_tokens", "lm_head"):
                assert torch.equal(torch.cat(parts)[: value.shape[0]], value), key
                assert not torch.cat(parts)[value.shape[0] :].any(), key
            elif module in ("o_proj", "down_proj") and key.endswith(".bias"):
                assert torch.equal(parts[0], value) and not parts[1].any(), key
            elif module in ("o_proj", "down_proj"):
                assert torch.equal(torch.cat(parts, 1), value), key
            elif module.endswith("_proj"):
                assert torch.equal(torch.cat(parts), value), key
            else:
                assert all(torch.equal(p, value) for p in parts), key
        if name == "fp8":
            assert isinstance(shards[1].model.layers[0].mlp.down_proj, Fp8Linear)


def test_a_split_that_cuts_an_fp8_scale_block_names_the_matrix(tmp_path):
    dense = make_tiny_model("qwen3", tmp_path / "dense", **{**QWEN_FP8_SHAPE, "intermediate_size": 384})
    write_qwen_fp8_checkpoint(dense, tmp_path / "fp8")
    cut = r"gate_proj has 384 output rows; engine\.tensor_parallel=2 gives each rank 192, which cuts its 128x128 FP8"
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.mlp\." + cut):
        load_model(str(tmp_path / "fp8"), tp=TensorParallel(0, 2))


def test_heads_that_do_not_split_are_one_line_errors(tiny, tmp_path):
    with pytest.raises(ConfigError, match="engine.tensor_parallel=3: .* has 4 attention heads, not divisible by 3$"):
        load_model(tiny["llama"], tp=TensorParallel(0, 3))
    with pytest.raises(ConfigError, match="engine.tensor_parallel=4: .* has 2 KV heads, not divisible by 4$"):
        load_model(tiny["llama"], tp=TensorParallel(0, 4))
    odd = make_tiny_model("llama", tmp_path / "odd", intermediate_size=97)
    with pytest.raises(ConfigError, match="engine.tensor_parallel=2: .* has 97 intermediate_size, not divisible by 2$"):
        load_model(str(odd), tp=TensorParallel(1, 2))


def test_tensor_parallel_key_is_checked(tiny):
    """Before any weight is read: N < 1, more ranks than GPUs, a level whose heads do not split."""
    with pytest.raises(ConfigError, match=r"override 'engine.tensor_parallel=0': engine\.tensor_parallel=0 must be"):
        load_config({"levels": [{"model": tiny["llama"]}]}, ["engine.tensor_parallel=0"])
    with pytest.raises(ConfigError, match=r"^engine\.tensor_parallel=9 but \d+ CUDA device\(s\) are visible$"):
        check_world(9, "cuda")
    with pytest.raises(ConfigError, match=r"engine\.device='cuda:1': with engine\.tensor_parallel rank i runs on"):
        load_config({"levels": [{"model": tiny["llama"]}], "engine": {"device": "cuda:1", "tensor_parallel": 2}})
    cfg = load_config({"levels": [{"model": tiny["llama"]}], "engine": {"tensor_parallel": 3}})
    with pytest.raises(ConfigError, match=r"^levels\[0\] \(model\): engine\.tensor_parallel=3: .* 4 attention heads"):
        check_before_loading(cfg, [[1, 2]])


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """Models of the three architectures sharing one vocabulary, and an EAGLE3 head for the llama one."""
    root = tmp_path_factory.mktemp("tp_family")
    vocab = TINY_CONFIGS["llama"]["vocab_size"]
    head, _ = published_layout(root / "head", dtype=torch.float32, sizes=(*SIZES, vocab, 40), scale=0.3)
    return {
        "llama": str(make_tiny_model("llama", root / "llama", seed=11)),
        "qwen2": str(make_tiny_model("qwen2", root / "qwen2", seed=12, vocab_size=vocab, num_key_value_heads=2)),
        "qwen3": str(make_tiny_model("qwen3", root / "qwen3", seed=13, vocab_size=vocab)),
        "head": str(head),
    }


def _decode(
    family, spec: str, temperature: float, tensor_parallel: int, rejection: dict | None = None, rows: int = 16, **smc
) -> list:
    """generate() of PROMPTS through a HierarchicalDecoder of the stack `spec` ("kind:model ..."); `rejection`: the
    rejection levels' draft keys (3 drafts a round by default); `rows`: engine.max_batch_rows."""
    levels = []
    for part in spec.split():
        kind, _, name = part.partition(":")
        levels.append({"kind": kind, "model": family[name or "head"], "temperature": temperature})
        levels[-1].update({"rejection": rejection or {"num_draft_tokens": 3}, "smc": smc}.get(kind, {}))
    engine = {"tensor_parallel": tensor_parallel, "kv_capacity_tokens": 1024, "max_batch_rows": rows}
    decoder = HierarchicalDecoder(load_config({"levels": levels, "engine": engine}))
    try:
        results = decoder.generate(PROMPTS, max_new_tokens=10, ignore_eos=True)
        assert_pools_empty(decoder)
        # again, after rank 0 reset the levels' statistics (a block fill plans from them): the same output
        again = decoder.generate(PROMPTS, max_new_tokens=10, ignore_eos=True)
        assert [r.token_ids for r in again] == [r.token_ids for r in results]
        return results
    finally:
        decoder.close()


GREEDY = ["model:llama rejection:qwen2", "eagle3 rejection:llama"]


@pytest.mark.spawns
@pytest.mark.parametrize("spec", GREEDY)
def test_greedy_stacks_decode_as_at_tp1(family, spec):
    """Two ranks (this process and a spawned one) decode every prompt token for token as one process does."""
    whole = _decode(family, spec, 0.0, 1)
    assert [r.token_ids for r in _decode(family, spec, 0.0, 2)] == [r.token_ids for r in whole]


@pytest.mark.spawns
@pytest.mark.timeout(400, method="thread")  # ranks choosing apart would wait on each other for ever
def test_auto_draft_shapes_are_timed_on_rank_0_and_chosen_alike_on_every_rank(family, monkeypatch):
    """`num_draft_tokens: auto` with `tree: auto` on two ranks: rank 0 times the draft shapes and hands its round
    times to the other rank with each turn's mode; both then read the same rounds and choose the same shapes, so
    they run the same forwards and collectives (without the times the other rank chose apart and both waited on
    each other's collectives). Greedy, so token for token what one process decodes, whatever shapes were chosen."""
    monkeypatch.setattr(hsmc.decoder, "TIMING_REPEATS", 1)  # rank 0 (this process) times; what matters is agreement
    shapes, rows = {"num_draft_tokens": "auto", "tree": "auto"}, len(PROMPTS)  # shapes timed at 1 and 3 rows
    whole = _decode(family, "model:llama rejection:qwen2", 0.0, 1, rejection=shapes, rows=rows)
    sharded = _decode(family, "model:llama rejection:qwen2", 0.0, 2, rejection=shapes, rows=rows)
    assert [r.token_ids for r in sharded] == [r.token_ids for r in whole]
    assert "mean_draft_tokens" in sharded[0].stats["levels"][-1]


SMC = {"particles": 4, "block_size": 3, "ess_threshold": 0.9}


@pytest.mark.spawns
@pytest.mark.parametrize("spec", ["model:llama smc:qwen3", "eagle3 rejection:llama smc:qwen2"])
def test_smc_stacks_at_t1_give_tp1s_particles_and_weights(family, spec):
    """Same seed, T = 1: the same particles (tokens and ends), the same resamplings and log weights within float32
    rounding, whether the target, proposal and head run on one rank or two."""
    whole, sharded = _decode(family, spec, 1.0, 1, **SMC), _decode(family, spec, 1.0, 2, **SMC)
    assert sum(r.smc.resamplings for r in whole) > 0  # the resampling decisions are compared too
    for a, b in zip(whole, sharded):
        assert [p.token_ids for p in a.smc.particles] == [p.token_ids for p in b.smc.particles]
        assert (a.smc.chosen, a.smc.resamplings) == (b.smc.chosen, b.smc.resamplings)
        weights = [[p.log_weight for p in r.smc.particles] for r in (a, b)]
        assert weights[0] == pytest.approx(weights[1], abs=1e-4)


@pytest.mark.spawns
def test_hsmc_generate_with_two_ranks_prints_tp1s_tokens(family, tmp_path, capsys):
    """The CLI path: `hsmc generate ... engine.tensor_parallel=2` starts its ranks and decodes greedily as one
    process does (a model stack: the bottom kind)."""
    config = tmp_path / "model.yaml"
    config.write_text(yaml.safe_dump({"levels": [{"model": family["qwen3"]}], "engine": {"kv_capacity_tokens": 1024}}))
    prompts = tmp_path / "ids.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    outputs = []
    for tp in (1, 2):
        overrides = [f"engine.tensor_parallel={tp}", "generation.max_new_tokens=12", "generation.ignore_eos=true"]
        assert main(["generate", "--config", str(config), "--prompts-file", str(prompts), "--json", *overrides]) == 0
        outputs.append([json.loads(line)["token_ids"] for line in capsys.readouterr().out.splitlines()])
    assert len(outputs[0]) == len(PROMPTS) and all(len(t) == 12 for t in outputs[0])
    assert outputs[1] == outputs[0]


@pytest.mark.spawns
def test_a_stack_that_fails_to_build_leaves_the_ranks_usable(family, tmp_path):
    """Every rank fails to load the level; rank 0 raises the one-line error naming it, and the same ranks then
    build and decode the next stack (a model stack: the bottom kind, greedy as at TP=1)."""
    (tmp_path / "empty").mkdir()
    levels = [{"model": family["llama"]}, {"kind": "rejection", "model": str(tmp_path / "empty")}]
    with pytest.raises(ModelLoadError, match=r"^levels\[1\] \(rejection\): .*empty: missing config\.json$"):
        HierarchicalDecoder(load_config({"levels": levels, "engine": {"tensor_parallel": 2}}))
    sharded = _decode(family, "model:qwen3", 0.0, 2)
    assert [r.token_ids for r in sharded] == [r.token_ids for r in _decode(family, "model:qwen3", 0.0, 1)]


@pytest.mark.spawns
def test_rank_0_reads_the_host_once_per_step_as_one_process_does(family):
    """The suite's host-read counter on rank 0 of two: a rejection top still reads the device once per verify
    step (the collectives and the per-turn control broadcast are no reads)."""
    levels = [{"model": family["llama"], "temperature": 0.8}, {"kind": "rejection", "model": family["qwen3"]}]
    decoder = HierarchicalDecoder(load_config({"levels": levels, "engine": {"tensor_parallel": 2}}))
    try:
        (short_reads, short_steps), (long_reads, long_steps) = (reads_and_steps(decoder, PROMPTS, n) for n in (6, 20))
    finally:
        decoder.close()
    assert long_steps > short_steps and long_reads > short_reads  # the counter sees rank 0's reads
    assert long_reads - short_reads <= long_steps - short_steps


@pytest.mark.spawns
def test_serve_with_two_ranks_answers_as_one_and_a_leaving_client_ends_on_every_rank(configs):  # noqa: F811
    """`hsmc serve`'s app over a decoder of two ranks: a client that leaves mid-stream cancels its request (on the
    followers too: the next request then runs as in one process), and a seeded completion is one process's."""
    body = {"model": "rejection", "prompt": "abc", "max_tokens": 12, "seed": 5, "ignore_eos": True}
    answers = []
    for tp in (1, 2):
        decoder = HierarchicalDecoder(load_config(configs["rejection"], [f"engine.tensor_parallel={tp}"]))
        try:
            with live_server(create_app(decoder, "rejection", 256)) as base:
                leaving = {**body, "max_tokens": 4000, "stream": True}
                with httpx.stream("POST", f"{base}/v1/completions", json=leaving) as response:
                    next(line for line in response.iter_lines() if line.startswith("data: "))
                wait_idle(decoder)
                assert metric(base, 'hsmc_requests_total{status="cancelled"}') == 1
                answers.append(httpx.post(f"{base}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"])
        finally:
            decoder.close()
    assert answers[0] == answers[1] and answers[0]


def test_control_channel_delivers_messages_whole_in_order_and_names_a_gone_rank_zero():
    """Rank 0's side and a follower's over a socket pair: a message larger than the socket's buffer arrives whole,
    messages arrive in the order sent, and a closed rank 0 is an HsmcError, not a hang or a half message."""
    leader, follower = (ControlChannel.__new__(ControlChannel) for _ in range(2))
    leader.peers, follower.peers = (list(pair) for pair in zip(socket.socketpair()))
    big = {"prompt": list(range(300_000))}  # ~1.5 MB pickled
    sender = threading.Thread(target=lambda: [leader.send(m) for m in (big, None, "third")])
    sender.start()
    assert [follower.receive() for _ in range(3)] == [big, None, "third"]
    sender.join()
    leader.close()
    with pytest.raises(HsmcError, match="rank 0 closed the control channel"):
        follower.receive()
    follower.close()
