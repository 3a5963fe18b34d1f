"""A `.gguf` model is dequantized once and loaded from a cached Hugging Face folder afterwards.

transformers' GGUF loader dequantizes every tensor on each load (about 3.5 min for a 1.5B model on a
CPU here). `converted_gguf` turns a GGUF into a folder with its config, fp32 safetensors weights and
tokenizer (chat template included) once, under `$HSMC_CACHE/gguf/<name>-<size>-<mtime>`: a file that is
replaced or edited gets a conversion of its own. A conversion is written to a temporary folder and
renamed into place, so a cached folder is complete or absent. It records the GGUF's sha256 and the size
and sha256 of every file it wrote; each load checks the sizes (cheap, unlike hashing gigabytes of fp32
weights on every start), so a truncated or replaced file is reported (ChecksumError, like the demo
model's assets) instead of loading wrong weights, and `check_conversion(folder, hashes=True)` verifies
the hashes too.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from hsmc.errors import ChecksumError, ModelLoadError

RECORD = "hsmc-gguf.json"


def cache_dir() -> Path:
    """Where hsmc keeps converted assets: $HSMC_CACHE, else ~/.cache/hsmc."""
    return Path(os.environ.get("HSMC_CACHE", Path.home() / ".cache" / "hsmc"))


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def converted_gguf(gguf: Path, root: Path | None = None) -> Path:
    """The cached Hugging Face folder converted from `gguf`, converting it first if there is none."""
    if not gguf.is_file():
        raise ModelLoadError(f"GGUF file not found: {gguf}")
    stat = gguf.stat()
    folder = (root or cache_dir()) / "gguf" / f"{gguf.stem}-{stat.st_size}-{stat.st_mtime_ns}"
    if folder.is_dir():
        check_conversion(folder)
        return folder
    return convert_gguf(gguf, folder)


def convert_gguf(gguf: Path, folder: Path) -> Path:
    """Dequantize `gguf` into `folder` (config, fp32 safetensors, tokenizer, and the record of what was written)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"hsmc: converting {gguf.name} to {folder} (once)", file=sys.stderr)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent))
    try:
        try:
            hf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        except (OSError, ValueError, KeyError) as e:
            raise ModelLoadError(f"{gguf}: transformers could not read this GGUF file: {e}") from e
        config = hf_model.config
        config.__dict__.pop("quantization_config", None)  # dequantized now: a plain fp32 checkpoint
        config.save_pretrained(tmp)
        state = hf_model.state_dict()
        if config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        weights = {k: v.contiguous() for k, v in state.items()}
        save_file(weights, tmp / "model.safetensors", metadata={"format": "pt"})
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
        files = {p.name: {"size": p.stat().st_size, "sha256": sha256_of(p)} for p in sorted(tmp.iterdir())}
        record = {"gguf": {"path": str(gguf.resolve()), "sha256": sha256_of(gguf)}, "files": files}
        (tmp / RECORD).write_text(json.dumps(record, indent=1))
        try:
            os.replace(tmp, folder)
        except OSError:
            if not (folder / RECORD).is_file():
                raise
            # another process converted the same file meanwhile: its folder is as good as ours
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when the conversion was renamed into place
    return folder


def check_conversion(folder: Path, hashes: bool = False) -> None:
    """Every file of a cached conversion has the size (and with `hashes` the sha256) recorded when it was written."""
    record_path = folder / RECORD
    if not record_path.is_file():
        raise ChecksumError(f"{folder} has no {RECORD}: not a complete hsmc conversion; delete it to convert again")
    for name, expected in json.loads(record_path.read_text())["files"].items():
        path = folder / name
        if not path.is_file():
            raise ChecksumError(f"{path} of the GGUF conversion cache is missing; delete {folder} to convert again")
        actual = {"size": path.stat().st_size, "sha256": sha256_of(path) if hashes else expected["sha256"]}
        if actual != expected:
            raise ChecksumError(
                f"{path} in the GGUF conversion cache has {actual}, expected {expected}; "
                f"delete {folder} to convert again"
            )
