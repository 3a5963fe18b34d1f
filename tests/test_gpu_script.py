"""scripts/gpu_engine_check.py's FP8 sections in their CPU dry run (`--device cpu --tiny`): the code the GPU
run executes, at small shapes, with the Triton kernel interpreted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_fp8_sections_run_and_check_what_they_claim(tmp_path):
    sections = "fp8gemm,fp8decode,fp8logits,fp8stack,fp8rss"
    env = {**os.environ, "TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1"}
    run = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gpu_engine_check.py"), "--out", str(tmp_path), "--device", "cpu",
         "--tiny", "--sections", sections],
        capture_output=True, text=True, env=env, cwd=REPO,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert "failed" not in run.stdout, run.stdout
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["fp8gemm"]["worst_rel_err"] < 1e-5  # fp32 activations: the kernel equals the reference
    fp8, bf16 = results["fp8logits"]["fp8"], results["fp8logits"]["bf16"]
    # on the CPU both models run the same dequantized bf16 matmuls (up to the threads' reduction order), so both
    # differ from the fp32 model alike
    for key in ("max_diff", "mean_diff"):
        assert fp8[key] == pytest.approx(bf16[key], rel=0.05), key
    for run_kind in ("weight-only fp8", "fp8 activations"):  # two prompts, 20 new tokens each (EOS ignored)
        assert results["fp8stack"][run_kind]["tokens"] == 2 * 20, run_kind
    assert len(results["fp8rss"]["shards"]) >= 3
    assert "fp8decode: needs CUDA" in (tmp_path / "summary.txt").read_text()
