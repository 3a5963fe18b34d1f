"""Level-stack configuration: every shipped config validates; bad stacks fail naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import make_tiny_model

from hsmc.config import load_config
from hsmc.decoder import HierarchicalDecoder
from hsmc.errors import ConfigError

CONFIGS = sorted(p for p in (Path(__file__).resolve().parents[1] / "configs").glob("*.yaml") if "train" not in p.name)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_configs_validate(path):
    cfg = load_config(path)
    assert cfg.levels[0].kind in ("model", "eagle3")


@pytest.mark.parametrize("name", ["train_eagle_demo.yaml", "train_eagle_smollm2_gpu.yaml"])
def test_training_configs_validate(name):
    from hsmc.training.trainer import load_train_config

    cfg = load_train_config(CONFIGS[0].parent / name)
    assert cfg.verifier == "smollm2-135m-instruct" and cfg.ttt_steps == 7


def test_headline_configs_are_the_three_level_stack_and_its_comparison_points():
    stacks = {
        "qwen3_32b.yaml": [("eagle3", "AngelSlim/Qwen3-8B_eagle3"), ("rejection", "Qwen/Qwen3-8B-FP8"),
                           ("smc", "Qwen/Qwen3-32B-FP8")],
        "qwen3_32b_bf16.yaml": [("eagle3", "AngelSlim/Qwen3-8B_eagle3"), ("rejection", "Qwen/Qwen3-8B"),
                                ("smc", "Qwen/Qwen3-32B")],
        "qwen3_8b_eagle3.yaml": [("eagle3", "AngelSlim/Qwen3-8B_eagle3"), ("rejection", "Qwen/Qwen3-8B-FP8")],
        "qwen3_8b_smc.yaml": [("model", "Qwen/Qwen3-0.6B"), ("smc", "Qwen/Qwen3-8B-FP8")],
    }  # fmt: skip
    for name, levels in stacks.items():
        cfg = load_config(CONFIGS[0].parent / name)
        assert [(lc.kind, lc.model) for lc in cfg.levels] == levels, name
        assert cfg.engine.device == "cuda" and cfg.engine.resolved_kv_capacity == "auto", name
        assert all(lc.temperature == 0.6 for lc in cfg.levels), name
    top = load_config(CONFIGS[0].parent / "qwen3_32b.yaml").levels[-1]
    assert (top.particles, top.block_size) == (6, 16)


def _levels(*levels):
    return {"levels": list(levels)}


M = {"kind": "model", "model": "m", "temperature": 1.0}
TREE = {"kind": "rejection", "model": "t", "tree": {"depth": 3, "topk": 2, "budget": 4}}


@pytest.mark.parametrize(
    "cfg,message",
    [
        (_levels({"kind": "smc", "model": "m", "temperature": 1.0}), r"levels\[0\].kind='smc': the bottom level"),
        (_levels({"kind": "rejection", "model": "m"}), r"levels\[0\].kind='rejection': the bottom level"),
        (_levels(M, {"kind": "smc", "model": "t", "temperature": 1.0}, M), r"levels\[1\].kind='smc' must be the top"),
        (_levels({**M, "temperature": 0.0}, {"kind": "smc", "model": "t", "temperature": 1.0}), "temperature > 0"),
        (_levels(M, {"kind": "smc", "model": "t", "temperature": 1.0, "particles": 0}), r"levels\[1\].particles"),
        (_levels(M, {"kind": "smc", "model": "t", "temperature": 1.0, "block_size": -1}), r"levels\[1\].block_size"),
        (_levels(M, {"kind": "smc", "model": "t", "temperature": 1.0, "alpha": 0}), r"levels\[1\].alpha"),
        (_levels(M, {"kind": "smc", "model": "t", "temperature": 0.0}), r"levels\[1\].temperature must be positive"),
        (_levels(M, {"kind": "smc", "model": "t", "temperature": 1.0, "resampling": "stratified"}), "resampling"),
        (_levels(M, {"kind": "rejection", "model": "t", "num_draft_tokens": 0}), r"levels\[1\].num_draft_tokens"),
        (_levels(M, M), r"levels\[1\].kind='model' drafts at the bottom: it samples on its own"),
        (_levels({**M, "num_layers": 0}), r"levels\[0\].num_layers"),
        (_levels({"kind": "eagle3", "model": "h"}, M), "directly under a rejection or smc level"),
        (_levels({"kind": "eagle3", "model": "h"}), "directly under a rejection or smc level"),
        (_levels(M, {"kind": "eagle3", "model": "h"}), r"levels\[1\].kind='eagle3' drafts at the bottom"),
        (_levels(M, {**TREE, "tree": {"depth": 0}}), r"levels\[1\].tree.depth must be positive"),
        (_levels(M, {**TREE, "tree": {"depth": 2, "topk": 2, "budget": 7}}), r"levels\[1\].tree.budget=7 exceeds"),
        (_levels(M, {**TREE, "tree_rule": "spectr"}), r"levels\[1\].tree_rule='spectr' is not one of"),
        (_levels({**M, "temperature": 0.0}, {**TREE, "tree_rule": "draft_aware"}), r"levels\[1\].tree_rule=.*> 0"),
        (_levels(M, {"kind": "rejection", "model": "r"}, TREE), r"levels\[2\].tree: trees are drafted by"),
        (_levels(M, {**TREE, "tree": None, "tree_rule": "bogus"}), r"levels\[1\].tree_rule='bogus' is not one of"),
        (_levels(M, {**TREE, "tree": None, "tree_rule": "traversal"}), r"tree_rule='traversal' verifies draft trees; "),
        (_levels({**M, "tree": TREE["tree"]}, TREE), r"levels\[0\].tree is a key of 'rejection' levels; this level"),
        (_levels(M, {**TREE, "particles": 8}), r"levels\[1\].particles is a key of 'smc' levels; this level is 'rej"),
        (_levels(M, {**TREE, "block_size": 2}), r"levels\[1\].block_size is a key of 'smc' levels"),
        (_levels(M, {"kind": "smc", "model": "t", "temperature": 1.0, "num_draft_tokens": 2}), "num_draft_tokens is"),
    ],
)
def test_invalid_stacks(cfg, message):
    with pytest.raises(ConfigError, match=message):
        load_config(cfg)


R = {"kind": "rejection", "model": "r", "temperature": 1.0}
SMC = {"kind": "smc", "model": "t", "temperature": 1.0}


@pytest.mark.parametrize(
    "kinds",
    [
        (M, R, R),
        (M, {**R, "temperature": 0.0}, R),
        (M, R, R, SMC),
        ({"kind": "eagle3", "model": "h", "temperature": 1.0}, R, R, R, SMC),
        (M, SMC),
        ({"kind": "eagle3", "model": "h", "temperature": 1.0}, SMC),
    ],
    ids=lambda levels: "-".join(level["kind"] for level in levels),
)
def test_stacks_of_any_depth_validate(kinds):
    assert [lc.kind for lc in load_config(_levels(*kinds)).levels] == [level["kind"] for level in kinds]


def test_models_with_different_vocabularies_are_refused(tmp_path):
    a = make_tiny_model("llama", tmp_path / "a")
    b = make_tiny_model("qwen3", tmp_path / "b")  # 89 tokens vs 101
    with pytest.raises(ConfigError, match=r"levels\[0\].model=.*vocab_size 101.*89"):
        HierarchicalDecoder.from_config(
            _levels({"model": str(a), "temperature": 1.0}, {"kind": "rejection", "model": str(b)})
        )


def test_layer_truncated_draft_loads_the_first_layers(tmp_path):
    path = make_tiny_model("qwen3", tmp_path / "m")
    decoder = HierarchicalDecoder.from_config(_levels({"model": str(path), "num_layers": 2}))
    model = decoder.stack.levels[0].state.runner.module
    assert model.config.num_layers == 2 and len(model.model.layers) == 2
    with pytest.raises(Exception, match="num_layers=9 but the model has 6 layers"):
        HierarchicalDecoder.from_config(_levels({"model": str(path), "num_layers": 9}))
