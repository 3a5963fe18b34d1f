"""Admission: which prompts decode together so that the rows and KV slots they may need fit."""

from __future__ import annotations

from collections.abc import Sequence

from hsmc.config import HsmcConfig, LevelConfig
from hsmc.errors import KVCapacityError


def plan_waves(
    prompt_lengths: Sequence[int],
    max_new_tokens: int,
    max_rows: int,
    capacity: int,
    rows_per_prompt: int = 1,
    lookahead: int = 0,
) -> list[list[int]]:
    """Group consecutive prompt indices into waves that fit `max_rows` rows and `capacity` slots.

    A prompt's rows share its prompt KV (fan-out by refcount) and each may grow by
    max_new_tokens + lookahead (tokens proposed past the end before they are rejected). The
    padded prefill needs (prompts in the wave) x longest prompt slots for a moment. Raises
    KVCapacityError naming the first prompt that could never fit on its own.
    """
    grow = max_new_tokens + lookahead
    waves: list[list[int]] = []
    current: list[int] = []
    total = longest = 0
    for i, n in enumerate(prompt_lengths):
        need = n + rows_per_prompt * grow
        if n + grow > capacity or need > capacity or rows_per_prompt > max_rows:
            raise KVCapacityError(
                f"prompt {i} has {n} tokens; with max_new_tokens={max_new_tokens} (+{lookahead} lookahead) "
                f"and {rows_per_prompt} row(s) it needs {need} KV slots and {rows_per_prompt} rows, more than "
                f"engine.kv_capacity_tokens={capacity} / engine.max_batch_rows={max_rows}"
            )
        grown_total, grown_longest = total + need, max(longest, n)
        too_many_rows = (len(current) + 1) * rows_per_prompt > max_rows
        if current and (too_many_rows or max(grown_total, (len(current) + 1) * grown_longest) > capacity):
            waves.append(current)
            current, grown_total, grown_longest = [], need, n
        current.append(i)
        total, longest = grown_total, grown_longest
    if current:
        waves.append(current)
    return waves


def lookahead_tokens(levels: Sequence[LevelConfig]) -> int:
    """Drafts not yet verified, SMC blocks not yet weighed, the surplus a rejection level buffers while it
    fills an SMC block, and the step (cycle) the decoder runs past a row's (group's) end while it reads the
    previous one (see `HierarchicalDecoder`, `SMCLevel`); finished SMC particles ride along with their group."""
    rejection = sum(c.num_draft_tokens + 1 for c in levels if c.kind == "rejection")
    top = levels[-1]
    fill = top.block_size if top.kind == "smc" and len(levels) > 1 and levels[-2].kind == "rejection" else 0
    overlap = {"smc": top.block_size + 1, "rejection": top.num_draft_tokens + 1}.get(top.kind, 1)
    return rejection + fill + overlap + sum(c.block_size + 1 for c in levels if c.kind == "smc")


def rows_and_lookahead(cfg: HsmcConfig) -> tuple[int, int]:
    """KV rows per prompt and tokens a row may hold past its output, from the config alone (the
    built stack reports the same through `Stack.rows_per_prompt` and `Stack.lookahead`)."""
    top = cfg.levels[-1]
    rows = top.particles if top.kind == "smc" else 1
    return rows, lookahead_tokens(cfg.levels)


def minimum_kv_tokens(cfg: HsmcConfig) -> int:
    """Slots one prompt's rows need beyond the prompt itself: the least an auto-sized pool must hold."""
    rows, lookahead = rows_and_lookahead(cfg)
    return rows * (cfg.generation.max_new_tokens + lookahead)
