"""Per-sample results as jsonl, appended as they are scored, so an interrupted run resumes where it stopped.

The first line holds the run's settings (`{"meta": ...}`); resuming with different settings is refused,
because mixing samples of two setups would make the summary meaningless.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hsmc.errors import HsmcError


class RecordFile:
    def __init__(self, path: Path, meta: dict[str, Any]) -> None:
        self.path = path
        self.records: dict[str, dict[str, Any]] = {}
        meta = json.loads(json.dumps(meta))  # the form it takes on disk, so the comparison is exact
        if path.is_file() and path.stat().st_size > 0:
            self._load(meta)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"meta": meta}) + "\n")

    def _load(self, meta: dict[str, Any]) -> None:
        lines = self.path.read_bytes().split(b"\n")
        stored = json.loads(lines[0])["meta"]
        if stored != meta:
            changed = sorted(k for k in meta.keys() | stored.keys() if meta.get(k) != stored.get(k))
            raise HsmcError(
                f"{self.path} was written by a run with other settings (differs in {', '.join(changed)}); "
                "delete it or choose another --out to start afresh"
            )
        kept = len(lines[0]) + 1
        for line in lines[1:-1]:  # lines[-1] is what follows the last newline: empty, or a torn write
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                break
            self.records[record["id"]] = record
            kept += len(line) + 1
        with self.path.open("r+b") as f:
            f.truncate(kept)

    def append(self, records: list[dict[str, Any]]) -> None:
        with self.path.open("a") as f:
            for record in records:
                f.write(json.dumps(record) + "\n")
                self.records[record["id"]] = record
            f.flush()
            os.fsync(f.fileno())
