"""GSM8K answer extraction, number normalisation, data loading and the prompt kept in evals/gsm8k.yaml."""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path

import pytest

from hsmc.errors import HsmcError
from hsmc.evals.gsm8k import Gsm8kSettings, Gsm8kTask, answers_match, extract_answer, load_rows, reference_answer
from hsmc.evals.settings import EVALS_DIR, load_task_settings

DATA = Path(__file__).resolve().parents[1] / "evals" / "data"


def test_extraction_recovers_every_reference_answer_of_the_test_split():
    rows = [json.loads(line) for line in (DATA / "gsm8k_test.jsonl").read_text().splitlines()]
    assert len(rows) == 1319
    for row in rows:
        # an independent reading of the reference: the text after '####', commas dropped
        expected = Decimal(row["answer"].split("####")[1].strip().replace(",", ""))
        extracted = extract_answer(row["answer"])
        assert extracted is not None and Decimal(extracted) == expected, row["answer"][-60:]
        assert reference_answer(row["answer"]) == extracted


@pytest.mark.parametrize(
    "text,expected",
    [
        ("#### 1,234", "1234"),
        ("#### $1,234.00", "1234"),
        ("The answer is #### $18.", "18"),
        ("#### -3", "-3"),
        ("it costs -$5.50", "-5.5"),
        ("it costs $-5.50", "-5.5"),
        ("#### 18.0", "18"),
        ("#### 0.50", "0.5"),
        ("#### 1,000,000", "1000000"),
        ("#### The total is 42 apples.", "42"),
        ("She had 5-6 apples and ate 2.", "2"),  # the last number; the '-' of a range is no sign
        ("first 12 then 30", "30"),  # no '####': the last number
        ("#### 7\nso maybe 9", "7"),  # '####' wins over a later number
        ("#### 18\n#### 20", "20"),  # the last '####'
        ("3.14159 is pi", "3.14159"),
        ("#### -0", "0"),
        ("no digits at all", None),
        ("####", None),
    ],
)
def test_number_formats(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "extracted,reference,same", [("18", "18", True), ("18.00", "18", True), ("1000", "1000", True), ("17", "18", False)]
)
def test_answers_compare_as_decimals(extracted, reference, same):
    assert answers_match(extracted, reference) is same
    assert answers_match(None, reference) is False


def test_prompt_settings_come_from_evals_folder():
    settings = load_task_settings(Gsm8kSettings, "gsm8k", None, [])
    assert settings.shots == 0 and settings.max_new_tokens == 256
    task = Gsm8kTask(settings, limit=3)
    assert task.source == str(DATA / "gsm8k_test.jsonl") and len(task.items) == 3
    question = load_rows(None)[0][0]["question"]
    assert task.items[0].prompt == settings.template.format(question=question)
    assert task.items[0].prompt.startswith(question) and '"####"' in task.items[0].prompt
    assert task.items[0].reference == "18" and task.items[0].id == "gsm8k/test/0"


def test_k_shot_prompt_shows_training_solutions_without_calculator_annotations():
    settings = load_task_settings(Gsm8kSettings, "gsm8k", None, ["task.shots=2"])
    task = Gsm8kTask(settings, limit=1)
    train = load_rows(None, "train")[0]
    prompt = task.items[0].prompt
    assert prompt.startswith(f"Question: {train[0]['question']}\nAnswer: ")
    assert train[1]["question"] in prompt and prompt.count("Question: ") == 2
    assert "<<" not in prompt and "#### 72" in prompt  # the first training answer, annotations removed
    assert prompt.endswith(settings.template.format(question=load_rows(None)[0][0]["question"]))


def test_task_settings_errors_name_the_cause(tmp_path):
    with pytest.raises(HsmcError, match="task settings .*nope.yaml not found"):
        load_task_settings(Gsm8kSettings, "gsm8k", tmp_path / "nope.yaml", [])
    with pytest.raises(HsmcError, match="shotz"):
        load_task_settings(Gsm8kSettings, "gsm8k", None, ["task.shotz=2"])
    assert (EVALS_DIR / "gsm8k.yaml").is_file()


def test_hub_source_fails_with_one_clear_error():
    with pytest.raises(HsmcError, match="--data no/such-dataset: cannot load it with datasets"):
        load_rows("no/such-dataset")
