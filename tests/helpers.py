"""Small drivers shared by the tests: an engine around one model, and transformers' reference."""

from __future__ import annotations

import torch

from hsmc.engine.kv_pool import BlockTables, SlotAllocator
from hsmc.engine.runner import ModelRunner
from hsmc.models.decoder import DecoderLM


def make_runner(
    model: DecoderLM, num_slots: int = 2048, max_rows: int = 16, max_row_tokens: int = 256, device: str = "cpu"
) -> ModelRunner:
    return ModelRunner(model, BlockTables(SlotAllocator(num_slots, device), max_rows, max_row_tokens))


def run_new_tokens(runner: ModelRunner, rows: list[int], new: list[list[int]], capture: tuple[int, ...] = ()):
    """Append `new[i]` to row `rows[i]` (ragged) and run them in ONE forward; returns per-row logits
    [n_i, V] and captured streams [n_i, len(capture), H]."""
    tables, device = runner.tables, runner.device
    r = torch.tensor(rows, device=device)
    counts = torch.tensor([len(n) for n in new], device=device)
    width = max(len(n) for n in new)
    start = tables.length[r].clone()
    tables.append(r, width)
    tables.rollback(r, width - counts, width)
    tokens = torch.zeros(len(rows), width, dtype=torch.int64, device=device)
    for i, n in enumerate(new):
        tokens[i, : len(n)] = torch.tensor(n, device=device)
    out = runner.forward(r, tokens, counts, start, int((start + counts).max()), capture)
    logits = runner.model.logits(out.hidden)
    return (
        [logits[i, : len(n)] for i, n in enumerate(new)],
        [out.captured[i, : len(n)] for i, n in enumerate(new)] if capture else None,
    )


@torch.no_grad()
def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([ids])).logits[0]


def assert_pools_empty(decoder) -> None:
    """Every level's KV pool is consistent and holds no slot after a generate() call."""
    from hsmc.engine.kv_pool import check_invariants

    for level in decoder.stack.levels:
        tables = level.tables if hasattr(level, "tables") else level.state.tables
        check_invariants(tables.allocator, [tables])
        assert tables.allocator.num_free() == tables.allocator.num_slots, f"{type(level).__name__} leaked KV slots"
