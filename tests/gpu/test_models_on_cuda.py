"""Models through the whole CUDA path (Triton kernels, CUDA graphs) against the CPU: the logits of a ragged batch
replayed through a decode graph against transformers, prompts prefilled in chunks narrow enough to replay decode
graphs, and the real SmolLM2-135M-Instruct (from its GGUF, where staged) decoding greedily as on the CPU."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from conftest import make_tiny_model
from helpers import assert_pools_empty, make_runner, run_new_tokens
from test_stacks_on_cuda import exact_float32, without_syncs  # noqa: F401 (a fixture)

from hsmc.decoder import HierarchicalDecoder
from hsmc.models.loading import load_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ROOT = Path(__file__).resolve().parents[2]


def greedy_on_cuda_and_cpu(levels: list[dict], prompts: list[list[int]], new_tokens: int, **engine) -> tuple:
    """Greedy tokens of the CPU reference and of CUDA (after a warm-up that captures the graphs, with every
    synchronizing call an error)."""
    cpu = HierarchicalDecoder.from_config({"levels": levels, "engine": {"kv_capacity_tokens": 4096, **engine}})
    want = [r.token_ids for r in cpu.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True)]
    cuda_engine = {"kv_capacity_tokens": 4096, "device": "cuda", **engine}
    cuda = HierarchicalDecoder.from_config({"levels": levels, "engine": cuda_engine})
    cuda.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True)
    got = without_syncs(lambda: cuda.generate(prompts, max_new_tokens=new_tokens, ignore_eos=True))
    cuda.driver.quiesce()
    assert_pools_empty(cuda)
    return [r.token_ids for r in got], want


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_ragged_batch_through_a_decode_graph_matches_transformers(arch, tmp_path):
    """Nine rows of 1..9 new tokens after contexts of 1..17 (one forward replaying a captured graph) against
    transformers on the CPU, fp32 without TF32: measured within 1e-5 of logits of magnitude ~3; a wrong position,
    mask or slot gives O(1)."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(arch, tmp_path / arch)
    from hsmc.ops.triton_backend import TritonBackend

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = load_model(str(path), device="cuda").model
    runner = make_runner(model, 2048, 16, 256, "cuda", backend=TritonBackend(), cuda_graphs=True)
    rng = random.Random(1)
    contexts = [[rng.randrange(80) for _ in range(n)] for n in (5, 1, 12, 3, 8, 2, 17, 6, 9)]
    new = [[rng.randrange(80) for _ in range(k)] for k in range(1, 10)]
    run_new_tokens(runner, list(range(9)), contexts)
    logits, _ = run_new_tokens(runner, list(range(9)), new)
    with torch.no_grad():
        for i in range(9):
            ref = hf(torch.tensor([contexts[i] + new[i]])).logits[0, len(contexts[i]) :]
            assert (logits[i].float().cpu() - ref).abs().max().item() < 1e-4


def test_prefill_chunks_that_replay_decode_graphs_equal_the_cpu(tmp_path):
    """Prompts of 1..40 tokens prefilled in chunks of 24 tokens over 4 rows (6 tokens per row and chunk: widths
    that replay the decode/verify graphs, whose outputs are reused buffers), then a rejection stack decodes greedily."""
    draft, target = make_tiny_model("llama", tmp_path / "d", seed=1), make_tiny_model("llama", tmp_path / "t", seed=2)
    levels = [{"model": str(draft), "temperature": 0.0},
              {"kind": "rejection", "model": str(target), "num_draft_tokens": 4}]  # fmt: skip
    rng = random.Random(3)
    prompts = [[rng.randrange(80) for _ in range(n)] for n in (1, 9, 40, 23)]
    got, want = greedy_on_cuda_and_cpu(levels, prompts, 16, prefill_chunk_tokens=24)
    assert got == want


def test_rejection_stack_with_rows_for_two_requests_equals_the_cpu(tmp_path):
    """Four requests through a [draft, rejection] stack with rows for two at a time: the others join as rows free
    (continuous batching changes the graphed shapes mid-run)."""
    draft, target = make_tiny_model("llama", tmp_path / "d", seed=1), make_tiny_model("llama", tmp_path / "t", seed=2)
    levels = [{"model": str(draft), "temperature": 0.0},
              {"kind": "rejection", "model": str(target), "num_draft_tokens": 4}]  # fmt: skip
    prompts = [[5, 9, 13], [7] * 11, [40, 41, 42, 43, 44, 45], [3, 4]]
    got, want = greedy_on_cuda_and_cpu(levels, prompts, 24, max_batch_rows=2)
    assert got == want


@pytest.fixture(scope="module")
def smollm2() -> Path:
    """The demo model converted from its GGUF, where the GGUF (or its conversion) is in the hsmc cache: the GPU
    machine cannot fetch it."""
    from hsmc.models.demo import DEMO_MODELS, demo_model_folder
    from hsmc.models.gguf import cache_dir

    name = "smollm2-135m-instruct"
    gguf = cache_dir() / Path(DEMO_MODELS[name].member).name
    if not (gguf.exists() or (cache_dir() / name / "config.json").is_file()):
        pytest.skip(f"SmolLM2 not staged: put {gguf.name} in {cache_dir()} ($HSMC_CACHE)")
    return demo_model_folder(name)


@pytest.mark.parametrize("stack", ["model", "truncated-draft-rejection", "eagle3-rejection"])
def test_smollm2_greedy_on_cuda_equals_the_cpu(smollm2, stack):
    """48 greedy tokens for three chat prompts: real weights make near-ties rare but possible, so this is the one
    check of float32 CUDA kernels against the CPU on a real model's logits (measured equal for every prompt)."""
    from hsmc.models.tokenizer import encode_prompt, load_tokenizer

    tokenizer = load_tokenizer(smollm2)
    prompts = [encode_prompt(tokenizer, p, True) for p in (
        "What is the capital of France? Answer in one sentence.",
        "Write a Python function that returns the factorial of n.",
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?",
    )]  # fmt: skip
    levels = {
        "model": [{"model": str(smollm2)}],
        "truncated-draft-rejection": [{"kind": "model", "model": str(smollm2), "num_layers": 12},
                                      {"kind": "rejection", "model": str(smollm2), "num_draft_tokens": 4}],
        "eagle3-rejection": [
            {"kind": "eagle3", "model": str(ROOT / "assets/eagle3-smollm2-135m-instruct"), "dtype": "float32"},
            {"kind": "rejection", "model": str(smollm2), "num_draft_tokens": 4}],
    }[stack]  # fmt: skip
    got, want = greedy_on_cuda_and_cpu(levels, prompts, 48)
    assert got == want
