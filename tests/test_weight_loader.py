"""The streaming loader: CPU memory while loading stays near one shard, whatever the model's size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import make_tiny_model

from hsmc.models.loading import safetensors_files

MEASURE = """
import json, sys
from hsmc.models.loading import load_model

def status(field):
    line = next(x for x in open("/proc/self/status") if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024

load_model(sys.argv[1], "bfloat16", num_layers=1)  # one-time costs (imports, first kernels) before measuring
with open("/proc/self/clear_refs", "w") as f:  # restart VmHWM from here
    f.write("5")
base = status("VmRSS")
model = load_model(sys.argv[1], "bfloat16").model
size = sum(p.numel() * p.element_size() for p in model.parameters())
print(json.dumps({"peak": status("VmHWM") - base, "model": size}))
"""


def test_loading_holds_about_one_shard_of_cpu_memory(tmp_path):
    """On the CPU the loaded model itself stays resident, so the bound is on what loading needs beyond it:
    the open shard's pages and one weight in flight, not the whole checkpoint (the fp32 checkpoint loads as
    bf16, so every byte is read and converted). glibc is told to return freed blocks (mmap threshold), so
    RSS measures live memory."""
    shape = dict(vocab_size=2048, hidden_size=512, intermediate_size=1536, num_hidden_layers=6, head_dim=64)
    folder = make_tiny_model("qwen3", tmp_path / "m", num_attention_heads=8, **shape)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(folder).save_pretrained(tmp_path / "sharded", max_shard_size="16MB")
    shards = safetensors_files(tmp_path / "sharded")
    largest = max(f.stat().st_size for f in shards)
    total = sum(f.stat().st_size for f in shards)
    assert len(shards) >= 5
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, str(tmp_path / "sharded")], capture_output=True, text=True, env=env, check=True
    )
    rss = json.loads(out.stdout.strip().splitlines()[-1])
    transient = rss["peak"] - rss["model"]
    assert transient <= 1.5 * largest, f"loading needed {transient / 2**20:.0f} MiB beyond the model: " + (
        f"{transient / largest:.2f} shards of {largest / 2**20:.0f} MiB ({total / 2**20:.0f} MiB in all)"
    )
