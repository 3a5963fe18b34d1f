"""`hsmc generate` end to end on the offline demo config, and its error reporting."""

from __future__ import annotations

from pathlib import Path

import pytest

from hsmc.cli import main

DEMO = str(Path(__file__).resolve().parents[1] / "configs" / "demo.yaml")


@pytest.mark.slow
def test_generate_demo_config_prints_answers_and_stats(capsys, smollm2_dir):
    assert main(["generate", "--config", DEMO, "generation.max_new_tokens=24"]) == 0
    out = capsys.readouterr().out
    answer = out.split("### What is the capital of France? Answer in one sentence.\n")[1].split("\n")[0]
    assert "Paris" in answer  # a sampled answer (T = 0.7): its exact words depend on the random stream
    assert "tok/s" in out and "total" in out
    assert "mean_accepted_length" in out and "resample_rate" in out  # per-level stats of the 3-level stack


@pytest.mark.slow
def test_prompts_file(tmp_path, capsys, smollm2_dir):
    prompts = tmp_path / "p.txt"
    prompts.write_text("What is 2 + 3?\n\nName a primary colour.\n")
    assert main(["generate", "--config", DEMO, "--prompts-file", str(prompts), "generation.max_new_tokens=8"]) == 0
    out = capsys.readouterr().out
    assert "### What is 2 + 3?" in out and "### Name a primary colour." in out


def test_bad_override_is_reported_with_its_key(capsys):
    assert main(["generate", "--config", DEMO, "engine.kv_capacity_tokens=0"]) == 2
    assert "engine.kv_capacity_tokens must be positive" in capsys.readouterr().err


def test_missing_config_file(capsys, tmp_path):
    assert main(["generate", "--config", str(tmp_path / "none.yaml")]) == 2
    assert "config file not found" in capsys.readouterr().err
