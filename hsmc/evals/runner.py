"""Run one config over a task: generate in fixed chunks, score, append records, resume what is done.

Chunk k always holds items [k·B, (k+1)·B) (B = `engine.max_batch_rows`, 64 when it is "auto") and is generated
with seed `generation.seed + k`, so a resumed run produces exactly the samples an uninterrupted one would.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from hsmc.config import HsmcConfig, load_config
from hsmc.evals.records import RecordFile
from hsmc.evals.task import Item, Task


def evaluate_config(
    task: Task, config_path: str, overrides: Sequence[str], out_path: Path, position: int = 0
) -> list[dict[str, Any]]:
    """Records (one per task item, in item order) of `config_path` + `overrides` on `task`, written to
    `out_path` as they are scored; items already recorded there are not generated again."""
    config = load_config(config_path, overrides)
    rows = config.engine.resolved_max_batch_rows
    chunk = rows if isinstance(rows, int) else 64
    meta = {"config": str(config_path), "resolved": dataclasses.asdict(config), "chunk": chunk, **task.meta()}
    records = RecordFile(out_path, meta)
    done = [item for item in task.items if item.id in records.records]
    correct = sum(records.records[item.id]["correct"] for item in done)
    todo_chunks = sorted({i // chunk for i, item in enumerate(task.items) if item.id not in records.records})
    with tqdm(
        total=len(task.items), initial=len(done), desc=out_path.stem, unit="q", position=position, file=sys.stderr
    ) as bar:
        bar.set_postfix_str(_accuracy(correct, len(done)))
        if todo_chunks:
            decoder = _load_decoder(config)
            for k in todo_chunks:
                items = task.items[k * chunk : (k + 1) * chunk]
                new = [r for r in _run_chunk(decoder, task, config, items, k) if r["id"] not in records.records]
                records.append(new)
                correct += sum(r["correct"] for r in new)
                bar.update(len(new))
                bar.set_postfix_str(_accuracy(correct, bar.n))
    return [records.records[item.id] for item in task.items]


def _accuracy(correct: int, n: int) -> str:
    return f"acc {correct / n:.3f} ({correct}/{n})" if n else "acc -"


def _load_decoder(config: HsmcConfig):
    from hsmc.decoder import HierarchicalDecoder

    return HierarchicalDecoder(config)


def _run_chunk(decoder, task: Task, config: HsmcConfig, items: list[Item], k: int) -> list[dict[str, Any]]:
    start = time.perf_counter()
    results = decoder.generate(
        [item.prompt for item in items], seed=config.generation.seed + k, **task.generation_overrides
    )
    seconds = time.perf_counter() - start
    scored = task.score(items, [r.text for r in results])
    return [
        {
            "id": item.id,
            "prompt": item.prompt,
            "reference": item.reference,
            "output": result.text,
            "extracted": s.extracted,
            "correct": s.correct,
            **({"detail": s.detail} if s.detail else {}),
            "tokens": result.stats["new_tokens"],
            "finish_reason": result.finish_reason,
            "seconds": result.stats["seconds"],
            "chunk": k,
            "chunk_seconds": seconds,
            "levels": result.stats["levels"],
        }
        for item, result, s in zip(items, results, scored)
    ]
