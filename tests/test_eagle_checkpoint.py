"""EAGLE3 checkpoints: the published layout is read and written exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hsmc.eagle.checkpoint import capture_layers, load_eagle3_head, new_head_config, save_eagle3_head
from hsmc.errors import ModelLoadError

SIZES = H, HEADS, KV, HD, INTER, VOCAB, DRAFT = 48, 4, 2, 12, 80, 101, 32


def published_layout(
    folder, architecture="LlamaForCausalLMEagle3", dtype=torch.bfloat16, seed=0, sizes=None, scale=0.1
):
    """A head as SpecForge/SGLang publish it, written by hand from the spec (not by hsmc).
    `sizes` overrides (H, HEADS, KV, HD, INTER, VOCAB, DRAFT) to fit another verifier."""
    H, HEADS, KV, HD, INTER, VOCAB, DRAFT = sizes or SIZES
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: (torch.randn(*shape, generator=g) * scale).to(dtype)  # noqa: E731
    ones = lambda n: (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)  # noqa: E731
    kept = torch.sort(torch.randperm(VOCAB, generator=g)[:DRAFT]).values
    state = {
        "fc.weight": r(H, 3 * H),
        "midlayer.self_attn.q_proj.weight": r(HEADS * HD, 2 * H),
        "midlayer.self_attn.k_proj.weight": r(KV * HD, 2 * H),
        "midlayer.self_attn.v_proj.weight": r(KV * HD, 2 * H),
        "midlayer.self_attn.o_proj.weight": r(H, HEADS * HD),
        "midlayer.mlp.gate_proj.weight": r(INTER, H),
        "midlayer.mlp.up_proj.weight": r(INTER, H),
        "midlayer.mlp.down_proj.weight": r(H, INTER),
        "midlayer.input_layernorm.weight": ones(H),
        "midlayer.hidden_norm.weight": ones(H),
        "midlayer.post_attention_layernorm.weight": ones(H),
        "norm.weight": ones(H),
        "lm_head.weight": r(DRAFT, H),
        "d2t": kept - torch.arange(DRAFT),
        "t2d": torch.zeros(VOCAB, dtype=torch.bool).index_fill_(0, kept, True),
    }
    config = {
        "architectures": [architecture], "model_type": "llama", "hidden_size": H, "intermediate_size": INTER,
        "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": HD, "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 256, "vocab_size": VOCAB,
        "draft_vocab_size": DRAFT, "tie_word_embeddings": False, "hidden_act": "silu",
    }  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(state, folder / "model.safetensors")
    return folder, state


@pytest.mark.parametrize("architecture", ["LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM"])
def test_published_layout_loads(tmp_path, architecture):
    folder, state = published_layout(tmp_path / "head", architecture)
    head, config = load_eagle3_head(str(folder), dtype="bfloat16")
    got = head.state_dict()
    assert set(got) == set(state)
    for k, v in state.items():
        assert torch.equal(got[k], v), k
    assert torch.equal(head.to_target_ids(torch.arange(DRAFT)), torch.nonzero(state["t2d"]).flatten())
    assert config["draft_vocab_size"] == DRAFT


def test_saved_head_has_exactly_the_published_keys_shapes_and_dtypes(tmp_path):
    folder, state = published_layout(tmp_path / "in")
    head, config = load_eagle3_head(str(folder), dtype="bfloat16")
    out = save_eagle3_head(head, config, tmp_path / "out")
    saved = load_file(out / "model.safetensors")
    assert {k: (tuple(v.shape), v.dtype) for k, v in saved.items()} == {
        k: (tuple(v.shape), v.dtype) for k, v in state.items()
    }
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]


def test_round_trip_load_save_load_is_identical(tmp_path):
    folder, _ = published_layout(tmp_path / "a", seed=3)
    head, config = load_eagle3_head(str(folder), dtype="float32")
    save_eagle3_head(head, config, tmp_path / "b")
    again, config_again = load_eagle3_head(str(tmp_path / "b"), dtype="float32")
    assert config_again == config
    a, b = head.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)


def test_layout_errors_name_the_problem(tmp_path):
    folder, state = published_layout(tmp_path / "h")
    save_file({f"model.{k}": v for k, v in state.items()}, folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"unexpected \['model.d2t'"):
        load_eagle3_head(str(folder))
    save_file({**state, "lm_head.weight": state["lm_head.weight"][:-1]}, folder / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"lm_head.weight has shape \(31, 48\), expected \(32, 48\)"):
        load_eagle3_head(str(folder))
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ModelLoadError, match="not an EAGLE3 head"):
        load_eagle3_head(str(folder))


def test_capture_layers_convention():
    assert capture_layers({}, 36) == (2, 18, 33)  # Qwen3-8B: hidden_states[2], [18], [33]
    assert capture_layers({"eagle_aux_hidden_state_layer_ids": [1, 17, 32]}, 36) == (2, 18, 33)
    with pytest.raises(ModelLoadError, match="does not fit"):
        capture_layers({"eagle_aux_hidden_state_layer_ids": [1, 17, 40]}, 36)


def test_new_head_config_copies_the_verifiers_sizes_and_rope():
    verifier = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                "intermediate_size": 12288, "rms_norm_eps": 1e-6, "vocab_size": 151936, "num_hidden_layers": 36,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}  # fmt: skip
    cfg = new_head_config(verifier, 32000)
    assert cfg["num_hidden_layers"] == 1 and cfg["draft_vocab_size"] == 32000 and cfg["tie_word_embeddings"] is False
    assert cfg["rope_parameters"] == verifier["rope_parameters"] and cfg["architectures"] == ["LlamaForCausalLMEagle3"]


def test_head_forward_matches_a_plain_reading_of_the_spec(tmp_path):
    """DESIGN §4 written out densely: fc(features) is the residual; attention input is
    cat(input_layernorm(embed), hidden_norm(h)); post-attention norm, SiLU MLP, residual; norm; lm_head."""
    import torch.nn.functional as F

    from hsmc.engine.kv_pool import BlockTables, SlotAllocator
    from hsmc.engine.runner import ModelRunner
    from hsmc.ops.backend import TorchBackend

    folder, w = published_layout(tmp_path / "h", dtype=torch.float32, seed=5)
    head, _ = load_eagle3_head(str(folder))
    t = 7
    g = torch.Generator().manual_seed(1)
    features, embeds = torch.randn(1, t, 3 * H, generator=g), torch.randn(1, t, H, generator=g)

    runner = ModelRunner(head, BlockTables(SlotAllocator(64), 1, 64), TorchBackend(), num_layers=1)
    rows = torch.tensor([0])
    batch = runner.new_tokens(rows, torch.zeros(1, t, dtype=torch.int64), torch.tensor([t]), t)
    with torch.no_grad():
        out, logits = runner.forward(batch, embeds=embeds, hidden=head.fc(features))

    def rms(x, weight):
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    def rope(x):  # x [t, heads, HD]
        inv = 1.0 / (10000.0 ** (torch.arange(0, HD, 2).float() / HD))
        ang = torch.arange(t).float()[:, None] * inv
        cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
        x1, x2 = x.chunk(2, -1)
        return x * cos + torch.cat([-x2, x1], -1) * sin

    h = features[0] @ w["fc.weight"].T
    x = torch.cat([rms(embeds[0], w["midlayer.input_layernorm.weight"]), rms(h, w["midlayer.hidden_norm.weight"])], -1)
    q = rope((x @ w["midlayer.self_attn.q_proj.weight"].T).view(t, HEADS, HD))
    k = rope((x @ w["midlayer.self_attn.k_proj.weight"].T).view(t, KV, HD)).repeat_interleave(HEADS // KV, 1)
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(t, KV, HD).repeat_interleave(HEADS // KV, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / HD**0.5
    scores = scores.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, -1) @ w["midlayer.self_attn.o_proj.weight"].T
    h = h + attn
    y = rms(h, w["midlayer.post_attention_layernorm.weight"])
    y = (F.silu(y @ w["midlayer.mlp.gate_proj.weight"].T) * (y @ w["midlayer.mlp.up_proj.weight"].T)) @ w[
        "midlayer.mlp.down_proj.weight"
    ].T
    h = h + y
    assert (out[0] - h).abs().max() < 1e-4  # the pre-norm output fed to the next draft step
    assert (logits[0] - rms(h, w["norm.weight"]) @ w["lm_head.weight"].T).abs().max() < 1e-4


SHIPPED_HEADS = sorted((Path(__file__).resolve().parents[1] / "assets").glob("eagle3-*"))


@pytest.mark.parametrize("folder", SHIPPED_HEADS, ids=lambda f: f.name)
def test_shipped_heads_are_smollm2s_shape_with_a_consistent_vocabulary_map(folder):
    """Each head in assets/ (the greedy-trained one and the T = 1 one) drafts for SmolLM2-135M-Instruct: its sizes,
    finite weights, and a draft vocabulary that maps back to 4096 distinct verifier tokens, each marked in `t2d`."""
    head, config = load_eagle3_head(str(folder))
    assert (config["hidden_size"], config["vocab_size"], config["draft_vocab_size"]) == (576, 49152, 4096)
    assert all(torch.isfinite(p).all() for p in head.parameters())
    tokens = torch.arange(4096) + head.d2t
    assert tokens.unique().numel() == 4096 and bool(head.t2d[tokens].all()) and int(head.t2d.sum()) == 4096
