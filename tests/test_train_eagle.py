"""`hsmc train-eagle` on a tiny verifier: learning happens, and an interrupted run resumes exactly."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from conftest import make_tiny_model

from hsmc.eagle.checkpoint import load_eagle3_head
from hsmc.errors import ConfigError
from hsmc.training import trainer
from hsmc.training.trainer import load_train_config, train_eagle
from hsmc.training.vocab import build_vocab_mapping


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    verifier = make_tiny_model("llama", root / "verifier", seed=6)
    gen = torch.Generator().manual_seed(0)
    prompts = root / "prompts.jsonl"
    prompts.write_text(
        "\n".join(
            json.dumps({"ids": torch.randint(3, 100, (int(n),), generator=gen).tolist()})
            for n in torch.randint(3, 9, (24,), generator=gen)
        )
    )
    return root, verifier, prompts


def _config(root, verifier, prompts, name, **kw):
    base = dict(
        verifier=str(verifier), prompts_file=str(prompts), prompt_field="ids", num_prompts=24, max_new_tokens=20,
        temperature=1.0, draft_vocab_size=64, steps=40, batch_size=6, lr=3e-3, warmup_steps=2, ttt_steps=3,
        checkpoint_every=10, output_dir=str(root / name),
    )  # fmt: skip
    return load_train_config({**base, **kw})


def _log(folder):
    return [json.loads(line) for line in (folder / "log.jsonl").read_text().splitlines()]


def test_loss_falls_and_top1_rises(setup):
    root, verifier, prompts = setup
    cfg = _config(root, verifier, prompts, "learn", steps=60)
    head_dir = train_eagle(cfg)
    log = _log(root / "learn")
    first, last = log[:5], log[-5:]
    mean = lambda rows, f: sum(f(r) for r in rows) / len(rows)  # noqa: E731
    # soft cross-entropy includes the verifier's own entropy (high for a random model): it cannot
    # approach 0, so the test asks for a clear absolute drop
    assert mean(last, lambda r: r["loss"]) < mean(first, lambda r: r["loss"]) - 0.25
    assert mean(last, lambda r: r["top1"][0]) > mean(first, lambda r: r["top1"][0]) + 0.1
    head, config = load_eagle3_head(str(head_dir))
    assert config["draft_vocab_size"] == 64 and int(head.t2d.sum()) == 64
    # 60 steps, a checkpoint every 10: the newest keep_checkpoints=2 stay, next to the exported head
    assert [step for step, _ in trainer.checkpoints(root / "learn")] == [50, 60]
    assert head_dir == root / "learn" / "head"


def test_counts_and_rates_out_of_range_are_refused_before_any_work(setup):
    """ttt_steps=0 would train a head on no unrolled step after the verifier had answered every prompt."""
    root, verifier, prompts = setup
    for key, value, says in [
        ("keep_checkpoints", 0, "must be positive, got 0"),
        ("ttt_steps", 0, "must be positive, got 0"),
        ("lr", -1.0, "must be positive, got -1.0"),
        ("generation_batch", 0, "must be positive, got 0"),
        ("warmup_steps", -1, "must be >= 0, got -1"),
        ("temperature", -0.5, "must be >= 0, got -0.5"),
    ]:
        with pytest.raises(ConfigError, match=f"train-eagle: {key} {says}"):
            _config(root, verifier, prompts, "none", **{key: value})
    with pytest.raises(ConfigError, match="export_dtype must be one of float32, bfloat16, float16, got 'fp8'"):
        _config(root, verifier, prompts, "none", export_dtype="fp8")


def test_the_head_is_exported_in_export_dtype(setup):
    """export_dtype=bfloat16 writes the trained float32 weights rounded to bf16 (the same run exported twice: the
    training is seeded), named so in config.json; the vocabulary maps stay integers."""
    from safetensors.torch import load_file

    root, verifier, prompts = setup
    heads = {
        dtype: train_eagle(_config(root, verifier, prompts, f"export-{dtype}", steps=3, export_dtype=dtype))
        for dtype in ("float32", "bfloat16")
    }
    full, half = (load_file(heads[d] / "model.safetensors") for d in ("float32", "bfloat16"))
    assert full.keys() == half.keys()
    for key, value in full.items():
        if value.is_floating_point():
            assert value.dtype == torch.float32 and half[key].dtype == torch.bfloat16, key
            assert torch.equal(half[key], value.to(torch.bfloat16)), key
        else:
            assert torch.equal(half[key], value), key
    assert json.loads((heads["bfloat16"] / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_interrupted_run_resumes_from_its_checkpoint_to_the_same_weights(setup, monkeypatch):
    root, verifier, prompts = setup
    straight = load_eagle3_head(str(train_eagle(_config(root, verifier, prompts, "straight", steps=20))))[0]

    calls = {"n": 0}
    real = trainer.ttt_loss

    def dies_at_step_13(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 13:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    cfg = _config(root, verifier, prompts, "resumed", steps=20)
    monkeypatch.setattr(trainer, "ttt_loss", dies_at_step_13)
    with pytest.raises(KeyboardInterrupt):
        train_eagle(cfg)
    assert [step for step, _ in trainer.checkpoints(root / "resumed")] == [10, 12]  # 12: saved on interrupt
    saved = torch.load(root / "resumed" / "checkpoint-12" / "pytorch_model.bin", weights_only=True)
    assert saved and all(k.startswith("head.") for k in saved)  # the head's state, not the verifier's embedding
    monkeypatch.setattr(trainer, "ttt_loss", real)
    resumed = load_eagle3_head(str(train_eagle(cfg)))[0]  # the same command again
    assert [r["step"] for r in _log(root / "resumed")] == list(range(1, 21))
    a, b = straight.state_dict(), resumed.state_dict()
    assert all(torch.allclose(a[k].float(), b[k].float(), atol=1e-6) for k in a)


def test_vocab_mapping_keeps_the_most_frequent_tokens_sorted():
    counts = torch.tensor([5, 0, 9, 9, 1, 7])
    d2t, t2d = build_vocab_mapping(counts, 3)
    kept = torch.arange(3) + d2t
    assert kept.tolist() == [2, 3, 5] and t2d.tolist() == [False, False, True, True, False, True]
    with pytest.raises(ValueError, match="draft_vocab_size"):
        build_vocab_mapping(counts, 7)


def test_prompts_from_a_datasets_dataset(setup):
    root, verifier, prompts = setup
    cfg = _config(root, verifier, prompts, "ds", prompts_file=None, dataset="json", dataset_files=str(prompts))
    from_datasets = trainer.read_prompts(cfg)
    from_file = trainer.read_prompts(_config(root, verifier, prompts, "file"))
    assert from_datasets == from_file and len(from_file) == 24


def test_training_unroll_equals_inference_drafting(tmp_path):
    """The TTT unroll and the drafting path run the same head forward: the logits of unroll step k at
    index t equal those of the k-th draft step after the pairs up to t were processed, when the draft
    steps are fed the same tokens (inference builds its KV step by step; training uses one masked cache)."""
    from test_eagle_checkpoint import published_layout

    from hsmc.engine.kv_pool import BlockTables, SlotAllocator
    from hsmc.engine.runner import ModelRunner
    from hsmc.ops.backend import TorchBackend
    from hsmc.training.ttt import ttt_unroll

    folder, _ = published_layout(tmp_path / "h", dtype=torch.float32, seed=3)
    head, _ = load_eagle3_head(str(folder))
    h, vocab, length, steps = head.config.hidden_size, head.config.vocab_size, 12, 4
    g = torch.Generator().manual_seed(0)
    embed = torch.nn.Embedding(vocab, h)
    torch.nn.init.normal_(embed.weight, generator=g)
    features = torch.randn(2, length, 3 * h, generator=g)
    tokens = torch.randint(0, vocab, (2, length), generator=g)
    with torch.no_grad():
        unrolled = ttt_unroll(head, features, embed(tokens), steps)
        for t in (0, 4, 7):
            runner = ModelRunner(head, BlockTables(SlotAllocator(64), 2, 64), TorchBackend(), num_layers=1)
            rows = torch.arange(2)
            pairs = t + 1  # (f_i, x_{i+1}) for i <= t, one causal forward
            batch = runner.new_tokens(rows, tokens[:, 1 : pairs + 1], torch.full((2,), pairs), pairs)
            hidden, logits = runner.forward(
                batch, embeds=embed(tokens[:, 1 : pairs + 1]), hidden=head.fc(features[:, :pairs])
            )
            hidden, logits = hidden[:, -1:], logits[:, -1]
            for k in range(steps):
                if k:  # draft step k: the head's own output, the token x_{t+1+k}, position t+k
                    token = tokens[:, t + 1 + k : t + 2 + k]
                    batch = runner.new_tokens(rows, token, torch.ones(2, dtype=torch.int64), pairs + k)
                    hidden, out = runner.forward(batch, embeds=embed(token), hidden=hidden)
                    logits = out[:, 0]
                assert (logits - unrolled[k][:, t]).abs().max() < 1e-4, (t, k)


def test_ttt_loss_is_the_decayed_soft_cross_entropy_of_each_step_at_each_scored_position(tmp_path):
    """The loss and top-1 agreement, recomputed position by position from the unroll's logits: step k at index i
    predicts x_{i+2+k} against softmax(verifier logits at position i+1+k, draft vocabulary), scored where that
    position is a response token whose verifier argmax the draft vocabulary holds (short rows: steps past the end
    score nothing)."""
    from test_eagle_checkpoint import published_layout

    from hsmc.training.ttt import TTTBatch, ttt_loss, ttt_unroll

    folder, _ = published_layout(tmp_path / "h", dtype=torch.float32, seed=5)
    head, _ = load_eagle3_head(str(folder))
    h, vocab, length, steps, decay = head.config.hidden_size, head.config.vocab_size, 9, 4, 0.8
    g = torch.Generator().manual_seed(1)
    features = torch.randn(2, length, 3 * h, generator=g)
    tokens = torch.randint(0, vocab, (2, length), generator=g)
    embeds = torch.randn(2, length, h, generator=g)
    logits = torch.randn(2, length, vocab, generator=g) * 3
    mask = torch.rand(2, length, generator=g) < 0.8
    mask[1, 5:] = False  # a short row
    batch = TTTBatch(features, tokens, embeds, logits, mask)
    with torch.no_grad():
        out = ttt_loss(head, batch, steps, decay)
        unrolled = ttt_unroll(head, features, embeds, steps)
    total = 0.0
    for k in range(steps):
        ces, hits = [], 0
        for b in range(2):
            for i in range(length - 1 - k):
                pos = i + 1 + k
                if not (mask[b, pos] and head.t2d[logits[b, pos].argmax()]):
                    continue
                target = torch.log_softmax(logits[b, pos, head.t2d], -1)
                logp = torch.log_softmax(unrolled[k][b, i], -1)
                ces.append(-(target.exp() * logp).sum())
                hits += int(logp.argmax() == target.argmax())
        assert ces, k  # the draw scores something at every step
        total += decay**k * float(sum(ces)) / len(ces)
        assert out.accuracy[k] == pytest.approx(hits / len(ces)), k
    assert float(out.loss) == pytest.approx(total, rel=1e-5)


@pytest.fixture(scope="module")
def cached(setup):
    """One generation of the responses (temperature 1.0), cached in its output_dir as data.pt."""
    root, verifier, prompts = setup
    cfg = _config(root, verifier, prompts, "cached")
    return cfg, trainer.generate_data(cfg, root / "cached", torch.device("cpu"))


def _no_generation(*args, **kwargs):
    raise AssertionError("the responses were generated again")


def test_cached_responses_with_the_same_settings_are_reused(setup, cached, monkeypatch):
    """A rerun differing only in fields that leave the responses as they are reads data.pt, generating nothing."""
    root, verifier, prompts = setup
    cfg, data = cached
    assert data["made_with"]["temperature"] == 1.0 and len(data["sequences"]) == 24
    monkeypatch.setattr(trainer, "read_prompts", _no_generation)
    rerun = _config(root, verifier, prompts, "cached", steps=5, lr=1e-3, batch_size=2, generation_batch=4)
    again = trainer.generate_data(rerun, root / "cached", torch.device("cpu"))
    assert again["sequences"] == data["sequences"] and torch.equal(again["counts"], data["counts"])


def test_cached_responses_made_with_other_settings_are_refused(setup, cached, monkeypatch):
    root, verifier, prompts = setup
    monkeypatch.setattr(trainer, "read_prompts", _no_generation)
    path = root / "cached" / "data.pt"
    greedy = _config(root, verifier, prompts, "cached", temperature=0.0)
    with pytest.raises(ConfigError, match=r"temperature=1\.0 \(this run: 0\.0\)") as refused:
        trainer.generate_data(greedy, root / "cached", torch.device("cpu"))
    message = str(refused.value)
    assert "\n" not in message and str(path) in message and "output_dir" in message and "delete it" in message
    assert "num_prompts" not in message  # only the fields that differ are named
    fewer = _config(root, verifier, prompts, "cached", temperature=0.0, num_prompts=12)
    with pytest.raises(ConfigError, match=r"num_prompts=24 \(this run: 12\)") as refused:
        trainer.generate_data(fewer, root / "cached", torch.device("cpu"))
    assert "temperature=1.0 (this run: 0.0)" in str(refused.value)
    assert torch.load(path, weights_only=True)["made_with"]["temperature"] == 1.0  # the cache is left as it was


def test_cached_responses_from_an_older_hsmc_are_reused_with_a_warning(setup, cached, monkeypatch, caplog):
    """A data.pt without the record cannot be checked: it loads (whatever the config says), and the log says so."""
    root, verifier, prompts = setup
    _, data = cached
    old = {key: value for key, value in data.items() if key != "made_with"}
    (root / "old").mkdir()
    torch.save(old, root / "old" / "data.pt")
    monkeypatch.setattr(trainer, "read_prompts", _no_generation)
    with caplog.at_level("WARNING", logger="hsmc.training.trainer"):
        loaded = trainer.generate_data(
            _config(root, verifier, prompts, "old", temperature=0.0), root / "old", torch.device("cpu")
        )
    assert loaded["sequences"] == data["sequences"] and "made_with" not in loaded
    [record] = [r for r in caplog.records if r.name == "hsmc.training.trainer"]
    assert record.levelname == "WARNING" and "cannot be checked" in record.getMessage()
    assert str(root / "old" / "data.pt") in record.getMessage()


def test_greedy_responses_are_reused_with_another_seed(setup, cached, monkeypatch):
    """At temperature 0 the responses are the argmax, whatever the seed (a fresh generation with another seed says
    so): a data.pt made greedily is reused by a greedy run with another seed. Sampled responses depend on it."""
    root, verifier, prompts = setup
    cpu = torch.device("cpu")
    greedy = trainer.generate_data(_config(root, verifier, prompts, "greedy", temperature=0.0), root / "greedy", cpu)
    reseeded = _config(root, verifier, prompts, "greedy-1", temperature=0.0, seed=1)
    assert trainer.generate_data(reseeded, root / "greedy-1", cpu)["sequences"] == greedy["sequences"]
    monkeypatch.setattr(trainer, "read_prompts", _no_generation)
    again = trainer.generate_data(reseeded, root / "greedy", cpu)
    assert again["sequences"] == greedy["sequences"] and again["made_with"]["seed"] == 0
    sampled = _config(root, verifier, prompts, "greedy", seed=1)  # temperature 1.0
    with pytest.raises(ConfigError, match=r"temperature=0\.0 \(this run: 1\.0\), seed=0 \(this run: 1\)"):
        trainer.generate_data(sampled, root / "greedy", cpu)
    with pytest.raises(ConfigError, match=r"made with seed=0 \(this run: 1\);"):  # data.pt of temperature 1.0
        trainer.generate_data(sampled, root / "cached", cpu)


def _trained(root, verifier, prompts, name, **kw):
    """A finished run in `root/name` on the `cached` fixture's responses (the generation settings are the same)."""
    (root / name).mkdir()
    shutil.copy(root / "cached" / "data.pt", root / name / "data.pt")
    train_eagle(_config(root, verifier, prompts, name, **kw))
    return root / name


def _not_loaded(*args, **kwargs):
    raise AssertionError("the verifier was loaded")


def test_resuming_with_other_training_settings_is_refused(setup, cached, monkeypatch):
    """A checkpoint records its run's settings; a rerun that changed one of them (lr, steps, the head's shape) is
    refused before anything is loaded or trained, naming the checkpoint, each differing key and the fix."""
    root, verifier, prompts = setup
    out = _trained(root, verifier, prompts, "stale", steps=4, checkpoint_every=2)
    assert [step for step, _ in trainer.checkpoints(out)] == [2, 4]
    recorded = json.loads((out / "checkpoint-4" / trainer.RUN_RECORD).read_text())
    assert recorded["lr"] == 3e-3 and recorded["steps"] == 4 and "checkpoint_every" not in recorded
    monkeypatch.setattr(trainer, "load_model", _not_loaded)
    with pytest.raises(ConfigError, match=r"lr=0\.003 \(this run: 0\.001\)") as refused:
        train_eagle(_config(root, verifier, prompts, "stale", steps=4, checkpoint_every=2, lr=1e-3))
    message = str(refused.value)
    assert "\n" not in message and f"{out / 'checkpoint-4'} was trained with" in message
    assert "delete the checkpoint-* folders" in message and "output_dir" in message
    assert not re.search(r"\bsteps=", message)  # only the keys that differ are named
    # more steps is not a resumed run: the cosine schedule of the first 4 steps decayed to 0 at step 4
    with pytest.raises(ConfigError) as refused:
        train_eagle(_config(root, verifier, prompts, "stale", steps=8, draft_vocab_size=32))
    message = str(refused.value)
    assert "steps=4 (this run: 8)" in message and "draft_vocab_size=64 (this run: 32)" in message
    assert "lr=" not in message
    assert [r["step"] for r in _log(out)] == [1, 2, 3, 4]  # nothing trained


def test_resuming_with_the_same_training_settings_continues(setup, cached, caplog):
    """Settings a checkpoint does not record (checkpoint_every, keep_checkpoints, export_dtype, generation_batch)
    may change: the run resumes from the newest checkpoint, and its checkpoints carry the same record."""
    root, verifier, prompts = setup
    out = _trained(root, verifier, prompts, "same", steps=6, checkpoint_every=3)
    shutil.rmtree(out / "checkpoint-6")  # as if the run had stopped after checkpoint-3
    again = _config(
        root, verifier, prompts, "same", steps=6, checkpoint_every=2, keep_checkpoints=3, export_dtype="bfloat16",
        generation_batch=4,
    )  # fmt: skip
    with caplog.at_level("WARNING", logger="hsmc.training.trainer"):
        train_eagle(again)
    assert [r["step"] for r in _log(out)] == [1, 2, 3, 4, 5, 6]  # 4..6 trained again from checkpoint-3, logged once
    assert [step for step, _ in trainer.checkpoints(out)] == [3, 4, 6]
    assert not [r for r in caplog.records if r.name == "hsmc.training.trainer"]
    first, last = ((out / f"checkpoint-{s}" / trainer.RUN_RECORD).read_text() for s in (3, 6))
    assert first == last
    for _, folder in trainer.checkpoints(out):  # starting over: a fresh run, and a fresh log
        shutil.rmtree(folder)
    train_eagle(again)
    assert [r["step"] for r in _log(out)] == [1, 2, 3, 4, 5, 6]


def test_a_checkpoint_from_an_older_hsmc_resumes_with_a_warning(setup, cached, caplog):
    """A checkpoint without the record cannot be checked: the run resumes from it, and the log says so."""
    root, verifier, prompts = setup
    out = _trained(root, verifier, prompts, "older", steps=4, checkpoint_every=2)
    shutil.rmtree(out / "checkpoint-4")
    (out / "checkpoint-2" / trainer.RUN_RECORD).unlink()
    with caplog.at_level("WARNING", logger="hsmc.training.trainer"):
        train_eagle(_config(root, verifier, prompts, "older", steps=4, checkpoint_every=2))
    assert [r["step"] for r in _log(out)] == [1, 2, 3, 4]  # resumed at checkpoint-2: 3 and 4 logged once
    [record] = [r for r in caplog.records if r.name == "hsmc.training.trainer"]
    assert record.levelname == "WARNING" and "cannot be checked" in record.getMessage()
    assert str(out / "checkpoint-2") in record.getMessage()
