"""Small drivers shared by the tests: an engine around one model, and transformers' reference."""

from __future__ import annotations

import torch

from hsmc.engine.kv_pool import BlockTables, SlotAllocator
from hsmc.engine.runner import ModelRunner
from hsmc.levels.base import SequenceState
from hsmc.models.decoder import DecoderLM
from hsmc.ops.backend import Backend, TorchBackend


def make_runner(
    model: DecoderLM,
    num_slots: int = 2048,
    max_rows: int = 16,
    max_row_tokens: int = 256,
    device: str = "cpu",
    capture: tuple[int, ...] = (),
    backend: Backend | None = None,
    cuda_graphs: bool = False,
) -> ModelRunner:
    tables = BlockTables(SlotAllocator(num_slots, device), max_rows, max_row_tokens)
    backend = backend or TorchBackend()
    return ModelRunner(model, tables, backend, model.config.num_layers, cuda_graphs=cuda_graphs, capture=capture)


def make_state(model: DecoderLM, max_rows: int, capacity: int, capture: tuple[int, ...] = ()) -> SequenceState:
    """A level's row state for `model` on the CPU reference backend."""
    runner = make_runner(model, capacity, max_rows, capacity, capture=capture)
    return SequenceState(runner, max_rows, capacity)


@torch.inference_mode()
def run_new_tokens(runner: ModelRunner, rows: list[int], new: list[list[int]]):
    """Append `new[i]` to row `rows[i]` (ragged) and run them in ONE forward; returns per-row logits
    [n_i, V] and captured streams [n_i, len(capture), H] (None without capture)."""
    device = runner.device
    r = torch.tensor(rows, device=device)
    counts = torch.tensor([len(n) for n in new], device=device)
    width = max(len(n) for n in new)
    tokens = torch.zeros(len(rows), width, dtype=torch.int64, device=device)
    for i, n in enumerate(new):
        tokens[i, : len(n)] = torch.tensor(n, device=device)
    context = int((runner.tables.length[r] + counts).max())
    batch = runner.new_tokens(r, tokens, counts, context)
    logits, features = runner.forward(batch)
    capture = runner.module_kwargs.get("capture", ())
    if features is not None:
        features = features.unflatten(-1, (len(capture), -1))
    return (
        [logits[i, : len(n)] for i, n in enumerate(new)],
        [features[i, : len(n)] for i, n in enumerate(new)] if capture else None,
    )


@torch.no_grad()
def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([ids])).logits[0]


def assert_pools_empty(decoder) -> None:
    """Every level's KV pool is consistent and holds no slot after a generate() call."""
    from hsmc.engine.kv_pool import check_invariants

    for level, runner in zip(decoder.stack.levels, decoder.stack.runners):
        tables = runner.tables
        check_invariants(tables.allocator, [tables])
        assert tables.allocator.num_free() == tables.allocator.num_slots, f"{type(level).__name__} leaked KV slots"


def assert_greedy_as_target_with_partial_acceptance(decoder, target, hf_greedy) -> None:
    """A T = 0 rejection stack (level 1 the verifier `target`, drafting 4 tokens a round) decodes four ragged
    prompts exactly as transformers' greedy decode of `target` (`hf_greedy(path, prompt, n)`), with drafts partly
    accepted, and leaves its pools empty."""
    prompts = [[5, 9, 13], [7] * 11, [40, 41, 42, 43, 44, 45], [3]]
    results = decoder.generate(prompts, max_new_tokens=24, ignore_eos=True)
    for prompt, result in zip(prompts, results):
        assert result.token_ids == hf_greedy(target, prompt, 24)
    accepted = results[0].stats["levels"][1]["mean_accepted_length"]
    assert 1.0 < accepted < 5.0, "drafts should be partly accepted (ragged rows)"
    assert_pools_empty(decoder)


def drawn_children(generator: torch.Generator):
    """A draft tree's children drawn without replacement (Gumbel-top-k) with noise from `generator`, for `grow`."""

    def children(depth: int, parents: torch.Tensor, logq: torch.Tensor, k: int):
        u = torch.rand(*logq.shape, generator=generator).clamp_min(1e-12)
        return (logq - torch.log(-torch.log(u))).topk(k, dim=-1).indices, logq.topk(k, dim=-1).values

    return children
