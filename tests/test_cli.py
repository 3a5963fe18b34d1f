"""`hsmc generate` / `hsmc train-eagle` end to end: output, flags, one-line errors (exit 2), Ctrl-C (exit 130)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml
from conftest import make_tiny_model

import hsmc
from hsmc.cli import main

REPO = Path(__file__).resolve().parents[1]
DEMO = str(REPO / "configs" / "demo.yaml")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A tiny random Qwen3 folder without tokenizer files: prompts are token ids."""
    return make_tiny_model("qwen3", tmp_path_factory.mktemp("cli") / "qwen3")


def _write_config(folder: Path, levels: list[dict], **sections) -> str:
    path = folder / "c.yaml"
    path.write_text(yaml.safe_dump({"levels": levels, **sections}))
    return str(path)


def _id_prompts(folder: Path, prompts: list[list[int]]) -> str:
    path = folder / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return str(path)


def _one_error_line(capsys, *fragments: str) -> str:
    """The CLI's stderr is exactly one `hsmc: error:` line containing every fragment."""
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hsmc: error: "), err
    assert "Traceback" not in err and "reference_type" not in err and "object_type" not in err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


# -- output ---------------------------------------------------------------------------------------


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


def test_overrides_anywhere_and_token_ids_printed_without_a_tokenizer(tiny, tmp_path, capsys):
    config = _write_config(tmp_path, [{"model": str(tiny)}])
    prompts = _id_prompts(tmp_path, [[3, 4, 5], [6, 7]])
    argv = ["generate", "generation.max_new_tokens=3", "--prompts-file", prompts, "generation.ignore_eos=true"]
    assert main([*argv, "--config", config, "generation.max_new_tokens=4"]) == 0  # the last override wins
    out = capsys.readouterr().out
    completions = [line for line in out.splitlines() if line.startswith("token ids: ")]
    assert len(completions) == 2 and all(len(json.loads(c.removeprefix("token ids: "))) == 4 for c in completions)
    assert "### [3, 4, 5]" in out and "### [6, 7]" in out


def test_single_prompt_shows_a_token_progress_bar_with_live_level_stats(tiny, tmp_path, capsys):
    levels = [{"model": str(tiny), "num_layers": 2, "temperature": 1.0}, {"kind": "rejection", "model": str(tiny)}]
    config = _write_config(tmp_path, levels, generation={"max_new_tokens": 12, "ignore_eos": True})
    assert main(["generate", "--config", config, "--prompts-file", _id_prompts(tmp_path, [[3, 4, 5]])]) == 0
    err = capsys.readouterr().err
    assert "tokens: 100%" in err and "12/12" in err and "tok/s" in err
    assert "accepted1=" in err  # the rejection level's mean accepted length, live


def test_version(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"hsmc {hsmc.__version__}" == f"hsmc {version('hsmc')}"


def test_help_does_not_import_torch_but_the_package_api_still_loads():
    script = (
        "import sys\nfrom hsmc.cli import main\ntry:\n    main(['generate', '--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'torch imported by --help'\n"
        "from hsmc import HierarchicalDecoder\nassert HierarchicalDecoder.__module__ == 'hsmc.decoder'\n"
        "assert 'torch' in sys.modules\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "--prompts-file" in run.stdout


# -- one-line user errors, exit code 2 ------------------------------------------------------------


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("levels:\n  - kind: model\n    model: m\n  foo: [1, 2\n")
    run = subprocess.run(
        [sys.executable, "-m", "hsmc.cli", "generate", "--config", str(bad)], capture_output=True, text=True
    )
    assert run.returncode == 2
    assert run.stderr.splitlines() == [f"hsmc: error: {bad}: YAML syntax error at line 4, column 3: "
                                       "did not find expected '-' indicator"]  # fmt: skip


def test_truncated_safetensors_file_is_named(tiny, tmp_path, capsys):
    folder = tmp_path / "m"
    shutil.copytree(tiny, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    config = _write_config(tmp_path, [{"model": str(folder)}])
    assert main(["generate", "--config", config, "--prompts-file", _id_prompts(tmp_path, [[3, 4]])]) == 2
    _one_error_line(capsys, f"levels[0] (model): {weights}: not a readable safetensors file")


def test_jsonl_line_without_prompt_names_file_and_line(tiny, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": [3, 4]}\n\n{"question": "x"}\n')
    config = _write_config(tmp_path, [{"model": str(tiny)}])
    assert main(["generate", "--config", config, "--prompts-file", str(prompts)]) == 2
    _one_error_line(capsys, f"{prompts}:3: no 'prompt' field (keys: question)")


def test_override_errors_are_blamed_on_the_override_not_the_file(capsys):
    assert main(["generate", "--config", DEMO, "engine.max_batch_row=3"]) == 2
    line = _one_error_line(capsys, "override 'engine.max_batch_row=3': engine.max_batch_row: Key 'max_batch_row'")
    assert "demo.yaml" not in line
    assert main(["generate", "--config", DEMO, "engine.kv_capacity_tokens=0"]) == 2
    _one_error_line(capsys, "override 'engine.kv_capacity_tokens=0': engine.kv_capacity_tokens must be positive")


def test_a_bad_value_in_the_file_is_blamed_on_the_file(tmp_path, capsys):
    config = _write_config(tmp_path, [{"model": "m"}], engine={"kv_capacity_tokens": 0})
    assert main(["generate", "--config", config, "generation.seed=3"]) == 2
    _one_error_line(capsys, f"{config}: engine.kv_capacity_tokens must be positive, got 0")


def test_override_of_a_level_that_does_not_exist(capsys):
    assert main(["generate", "--config", DEMO, "levels.5.model=x"]) == 2
    _one_error_line(capsys, "override 'levels.5.model=x': index 5 is out of range: the config has 3 levels")


def test_omegaconf_details_are_cut_to_one_line_with_the_full_key(capsys):
    assert main(["generate", "--config", DEMO, "generation.max_new_tokens=many"]) == 2
    _one_error_line(capsys, "generation.max_new_tokens: Value 'many' of type 'str' could not be converted to Integer")


def test_missing_config_file(capsys, tmp_path):
    assert main(["generate", "--config", str(tmp_path / "none.yaml")]) == 2
    _one_error_line(capsys, "config file not found")


def test_unknown_option_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--config", DEMO, "--prompt", "x", "--temperature", "1"])
    assert exit_.value.code == 2
    _one_error_line(capsys, "unrecognized arguments: --temperature - config overrides are key=value")


@pytest.mark.parametrize(
    "argv,option",
    [
        (["eval", "gsm8k", "--config", DEMO, "--limit", "-3"], "--limit"),  # would have dropped the last 3 questions
        (["bench", "--shape", "qwen3-8b", "--new-tokens", "0"], "--new-tokens"),
        (["serve", "--config", DEMO, "--max-queue", "many"], "--max-queue"),
    ],
)
def test_a_count_below_one_is_refused_naming_its_option(argv, option, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    _one_error_line(capsys, f"argument {option}: takes an integer >= 1, got")


def test_a_key_of_another_kind_of_level_is_refused_not_ignored(capsys):
    assert main(["generate", "--config", DEMO, "levels.0.tree.depth=3"]) == 2
    _one_error_line(capsys, "override 'levels.0.tree.depth=3': levels[0].tree is a key of 'rejection' levels; this")
    assert main(["generate", "--config", DEMO, "levels.1.tree_rule=traversal"]) == 2
    _one_error_line(capsys, "levels[1].tree_rule='traversal' verifies draft trees; this level drafts chains")


def test_model_missing_at_check_time_names_its_level(tiny, tmp_path, capsys):
    levels = [{"model": str(tiny), "temperature": 1.0}, {"kind": "rejection", "model": str(tmp_path / "nowhere")}]
    config = _write_config(tmp_path, levels)
    assert main(["generate", "--config", config, "--prompts-file", _id_prompts(tmp_path, [[3, 4]])]) == 2
    _one_error_line(capsys, "levels[1] (rejection): model", "nowhere")


def test_model_failing_while_loading_names_its_levels(tiny, tmp_path, capsys):
    """Weights that do not fit the config pass the header check and fail in the loader: still named."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "m"
    shutil.copytree(tiny, folder)
    state = load_file(folder / "model.safetensors")
    del state["model.layers.1.self_attn.q_norm.weight"]
    save_file(state, folder / "model.safetensors")
    levels = [
        {"model": str(tiny), "temperature": 1.0},
        {"kind": "rejection", "model": str(folder), "temperature": 1.0},
        {"kind": "smc", "model": str(folder), "temperature": 1.0},
    ]
    config = _write_config(tmp_path, levels)
    assert main(["generate", "--config", config, "--prompts-file", _id_prompts(tmp_path, [[3, 4]])]) == 2
    _one_error_line(capsys, "levels[1] (rejection), levels[2] (smc): ", "weights do not match", "q_norm")


def test_internal_bugs_keep_their_traceback(tiny, tmp_path, monkeypatch):
    import hsmc.preflight

    def broken(*args, **kwargs):
        raise ValueError("an internal bug")

    monkeypatch.setattr(hsmc.preflight, "check_before_loading", broken)
    config = _write_config(tmp_path, [{"model": str(tiny)}])
    with pytest.raises(ValueError, match="an internal bug"):
        main(["generate", "--config", config, "--prompts-file", _id_prompts(tmp_path, [[3, 4]])])


def test_a_multi_line_message_from_a_library_prints_as_one_line(tiny, tmp_path, capsys, monkeypatch):
    import hsmc.preflight
    from hsmc.errors import ModelLoadError

    def offline(*args, **kwargs):
        raise ModelLoadError("model 'x': not cached:\n  Cannot find the requested files\n  in the local cache.")

    monkeypatch.setattr(hsmc.preflight, "check_before_loading", offline)
    config = _write_config(tmp_path, [{"model": str(tiny)}])
    assert main(["generate", "--config", config, "--prompts-file", _id_prompts(tmp_path, [[3, 4]])]) == 2
    line = _one_error_line(capsys)
    assert line == "hsmc: error: model 'x': not cached: Cannot find the requested files in the local cache."


# -- Ctrl-C, exit code 130 ------------------------------------------------------------------------


def test_ctrl_c_during_generate_prints_the_finished_prompts(tiny, tmp_path):
    config = _write_config(
        tmp_path,
        [{"model": str(tiny)}],
        generation={"max_new_tokens": 200, "ignore_eos": True},  # long enough that SIGINT lands mid-run
        engine={"max_batch_rows": 1},  # one prompt per wave: they finish one after another
    )
    prompts = _id_prompts(tmp_path, [[3 + i, 4, 5] for i in range(8)])
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "hsmc.cli", "generate", "--config", config, "--prompts-file", prompts],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        # as in a terminal: a runner that started these tests in the background may ignore SIGINT,
        # and a child inherits that (Python then installs no KeyboardInterrupt handler)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    stderr = bytearray()
    first_done = threading.Event()

    def read_stderr() -> None:  # off a terminal the bar may skip counts: any of 1..7 finished will do
        while chunk := proc.stderr.read1(4096):
            stderr.extend(chunk)
            if re.search(rb" [1-7]/8 ", stderr):
                first_done.set()

    reader = threading.Thread(target=read_stderr)
    reader.start()
    try:
        assert first_done.wait(timeout=600), stderr.decode()
        proc.send_signal(signal.SIGINT)
        out = proc.stdout.read().decode()
        assert proc.wait(timeout=300) == 130
    finally:
        proc.kill()
        reader.join()
    lines = stderr.decode().replace("\r", "\n").strip().splitlines()
    finished = out.count("token ids: ")
    assert 1 <= finished < 8
    assert (
        lines[-1]
        == f"hsmc: interrupted; {finished} of 8 prompts finished; their completions and stats are printed above"
    )
    assert "Traceback" not in stderr.decode()
    assert "### [3, 4, 5]" in out and "total" in out and "level" in out  # the first prompt and the stats tables
    assert out.count("length") == finished  # one stats row per finished prompt


def test_ctrl_c_during_train_eagle_saves_and_exits_130(tiny, tmp_path, capsys, monkeypatch):
    from hsmc.training import trainer

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"ids": [3 + i, 4, 5, 6]}) + "\n" for i in range(6)))
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump({
        "verifier": str(tiny), "prompts_file": str(prompts), "prompt_field": "ids", "num_prompts": 6,
        "max_new_tokens": 8, "draft_vocab_size": 32, "steps": 20, "batch_size": 2, "ttt_steps": 2,
        "checkpoint_every": 100, "output_dir": str(tmp_path / "run"),
    }))  # fmt: skip
    real, calls = trainer.ttt_loss, {"n": 0}

    def interrupted_at_step_4(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer, "ttt_loss", interrupted_at_step_4)
    assert main(["train-eagle", "--config", str(config)]) == 130
    err = capsys.readouterr().err
    saved = tmp_path / "run" / "checkpoint-3"
    assert saved.is_dir() and "Traceback" not in err
    assert err.strip().splitlines()[-1] == f"hsmc: interrupted; saved {saved}; rerun the same command to resume"
