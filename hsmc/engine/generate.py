"""Autoregressive decoding through the engine: admission in waves, batched prefill, decode loop.

Prompts that fit together (rows and KV slots, worst case prompt + max_new_tokens) share one
batch; the rest wait for the next wave. A row's tokens are appended to its block table once
and every step runs all unfinished rows in one forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hsmc.engine.kv_pool import KVCapacityError
from hsmc.engine.runner import ModelRunner
from hsmc.engine.sampler import sample


@dataclass
class Completion:
    token_ids: list[int]  # generated ids only, the stop token included
    finish_reason: str  # "stop" (an end-of-sequence token) or "length"


def plan_waves(
    prompt_lengths: Sequence[int], max_new_tokens: int, max_rows: int, max_row_tokens: int, num_slots: int
) -> list[list[int]]:
    """Group prompt indices into batches whose worst-case KV need fits the pool.

    A wave needs sum(prompt + max_new_tokens) slots at the end, and rows x longest prompt
    during its padded prefill (the padding slots are returned right after). Raises
    KVCapacityError naming the first prompt that could never fit on its own.
    """
    limit = min(max_row_tokens, num_slots)
    waves: list[list[int]] = []
    current: list[int] = []
    total = longest = 0
    for i, n in enumerate(prompt_lengths):
        if n + max_new_tokens > limit:
            raise KVCapacityError(
                f"prompt {i} has {n} tokens; with max_new_tokens={max_new_tokens} it needs {n + max_new_tokens} "
                f"KV slots, more than engine.kv_capacity_tokens={limit}"
            )
        grown_total, grown_longest = total + n + max_new_tokens, max(longest, n)
        if current and (len(current) == max_rows or max(grown_total, (len(current) + 1) * grown_longest) > num_slots):
            waves.append(current)
            current, grown_total, grown_longest = [], n + max_new_tokens, n
        current.append(i)
        total, longest = grown_total, grown_longest
    if current:
        waves.append(current)
    return waves


class AutoregressiveGenerator:
    """Ancestral sampling (greedy at temperature 0) from one model."""

    def __init__(self, runner: ModelRunner, temperature: float, seed: int) -> None:
        self.runner = runner
        self.temperature = temperature
        self.generator = torch.Generator(runner.device).manual_seed(seed)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        stop_token_ids: Sequence[int] = (),
        on_finish: Callable[[int], None] | None = None,
    ) -> list[Completion]:
        """Complete every prompt; `on_finish(i)` is called as prompt i completes (progress bars)."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        tables = self.runner.tables
        waves = plan_waves(
            [len(p) for p in prompts],
            max_new_tokens,
            tables.max_rows,
            tables.max_row_tokens,
            tables.allocator.num_slots,
        )
        results: list[Completion] = []
        for wave in waves:
            finished = (lambda j, wave=wave: on_finish(wave[j])) if on_finish else (lambda j: None)
            results += self._run_wave([prompts[i] for i in wave], max_new_tokens, set(stop_token_ids), finished)
        return results  # waves are consecutive runs of prompt indices

    def _run_wave(
        self, prompts: list[Sequence[int]], max_new_tokens: int, stop: set[int], finished: Callable[[int], None]
    ) -> list[Completion]:
        runner, tables, device = self.runner, self.runner.tables, self.runner.device
        rows = torch.arange(len(prompts), device=device)
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        longest = max(len(p) for p in prompts)
        padded = torch.zeros(len(prompts), longest, dtype=torch.int64, device=device)
        for i, p in enumerate(prompts):
            padded[i, : len(p)] = torch.tensor(p)
        tables.append(rows, longest)
        tables.rollback(rows, longest - lengths, longest)
        try:
            out = runner.forward(rows, padded, lengths, torch.zeros_like(lengths), longest)
            last = out.hidden[torch.arange(len(prompts), device=device), lengths - 1]
            next_tokens, _ = sample(runner.model.logits(last), self.temperature, self.generator)
            completions = [Completion([], "length") for _ in prompts]
            active = list(range(len(prompts)))
            context = longest
            while True:
                still, keep = [], []
                for pos, (i, tok) in enumerate(zip(active, next_tokens.tolist())):
                    completions[i].token_ids.append(tok)
                    if tok in stop:
                        completions[i].finish_reason = "stop"
                    if tok in stop or len(completions[i].token_ids) == max_new_tokens:
                        finished(i)
                    else:
                        still.append(i)
                        keep.append(pos)
                if not still:
                    return completions
                active = still
                act_rows = rows[torch.tensor(still, device=device)]
                feed = next_tokens[torch.tensor(keep, device=device)]
                start = tables.length[act_rows]
                tables.append(act_rows, 1)
                context += 1
                ones = torch.ones_like(start)
                out = runner.forward(act_rows, feed[:, None], ones, start, context)
                next_tokens, _ = sample(runner.model.logits(out.hidden[:, 0]), self.temperature, self.generator)
        finally:
            tables.release(rows)
