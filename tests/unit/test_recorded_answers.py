"""Recorded answers: which prompt asks which question, the CSV, and the engine replaying them."""
from __future__ import annotations

import csv

import pytest

from worker.engine.sampling_params import SamplingParams
from worker.engine.tokenizer import ByteTokenizer
from worker.simulator.recorded import RecordedAnswers, RecordedAnswersError, question_of
from worker.simulator.runner import RecordedAnswerRunner, build_simulated_engine

DATASET = "/work/shared/datasets/routellm_gsm8k_responses.csv"
TOK = ByteTokenizer()


def _chat(*messages):
    return TOK.apply_chat_template([{"role": r, "content": c} for r, c in messages])


@pytest.mark.parametrize("text, question", [
    ("  How many eggs?\n", "How many eggs?"),
    (_chat(("user", "How many eggs?")), "How many eggs?"),
    (_chat(("system", "Be brief."), ("user", " How many eggs? ")), "How many eggs?"),
    (_chat(("user", "first"), ("assistant", "a"), ("user", "How many eggs?")), "How many eggs?"),
])
def test_the_question_is_the_prompt_or_the_last_user_message(text, question):
    assert question_of(text) == question


def _write(path, rows, fields=("prompt", "weak_response", "strong_response")):
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=list(fields))
        w.writeheader()
        w.writerows(rows)
    return path


def test_the_recorded_dataset_answers_every_question_with_its_models_text():
    answers = RecordedAnswers.from_csv(DATASET, "gpt-4-1106-preview")
    with open(DATASET, newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    assert len(answers) == len(rows) == 1319
    assert answers.find(_chat(("user", rows[0]["prompt"]))) == rows[0]["gpt-4-1106-preview_response"]
    weak = RecordedAnswers.from_csv(DATASET, "mistralai/Mixtral-8x7B-Instruct-v0.1")
    assert weak.find(rows[5]["prompt"]) == rows[5]["mistralai/Mixtral-8x7B-Instruct-v0.1_response"]


def test_a_prompt_that_only_quotes_a_question_is_not_answered(tmp_path):
    answers = RecordedAnswers.from_csv(_write(tmp_path / "a.csv", [
        {"prompt": "How many eggs?", "weak_response": "12", "strong_response": "#### 9"}]), "weak")
    rubric = _chat(("user", "Rate this answer.\nQuestion: How many eggs?\nAnswer: 12"))
    assert answers.find(rubric) is None and answers.find("How many eggs?") == "12"


def test_a_missing_model_column_names_the_models_in_the_file(tmp_path):
    path = _write(tmp_path / "a.csv", [{"prompt": "q", "weak_response": "a", "strong_response": "b"}])
    with pytest.raises(RecordedAnswersError, match="models in this file: weak, strong"):
        RecordedAnswers.from_csv(path, "gpt-5")


def test_a_prompt_recorded_twice_is_refused(tmp_path):
    path = _write(tmp_path / "a.csv", [{"prompt": "q", "weak_response": "a", "strong_response": "b"},
                                       {"prompt": " q ", "weak_response": "c", "strong_response": "d"}])
    with pytest.raises(RecordedAnswersError, match="recorded twice"):
        RecordedAnswers.from_csv(path, "weak")


def test_the_engine_replays_the_answer_even_when_the_prompt_is_a_cache_hit(tmp_path):
    answer = "Janet sells 16 - 3 - 4 = 9 eggs × $2.\n#### 18"
    answers = RecordedAnswers("m", {"How much does Janet make? " * 8: answer})
    engine, runner = build_simulated_engine("H100-80G", "llama-3-8b", time_scale=1e6, num_kv_blocks=256,
                                            answers=answers)
    assert isinstance(runner, RecordedAnswerRunner)
    prompt = TOK.encode(_chat(("user", "How much does Janet make? " * 8)))
    first, second = engine.generate([prompt, prompt], SamplingParams(max_tokens=500, temperature=0))
    for out in (first, second):
        assert out.new_text == answer and out.finish_reason == "stop"
        assert len(out.token_ids) == len(answer.encode()) + 1  # the answer's bytes, then EOS
    again = engine.generate([prompt], SamplingParams(max_tokens=500))[0]
    assert again.num_cached_tokens > 0 and again.new_text == answer
    truncated = engine.generate([prompt], SamplingParams(max_tokens=5))[0]
    assert (truncated.new_text, truncated.finish_reason) == (answer[:5], "length")
    # A finished request is forgotten at the next step: only the last one can still be held.
    assert len(runner._tokens) <= 1


@pytest.mark.parametrize("argv, message", [
    (["--sim-answers", "a.csv", "--sim-answers-model", "m"], "needs --simulate"),
    (["--simulate", "--sim-answers", "a.csv"], "and --sim-answers-model"),
    (["--simulate", "--sim-answers-model", "m"], "--sim-answers-model needs --sim-answers FILE"),
])
def test_the_recorded_mode_needs_the_simulator_a_file_and_a_model(argv, message):
    from protocol.settings import SettingsError
    from worker.server.config import load_server_config

    with pytest.raises(SettingsError, match=message):
        load_server_config(argv, environ={})


def test_the_recorded_model_is_the_served_name_by_default():
    from worker.server.config import load_server_config

    cfg = load_server_config(["--simulate", "--sim-answers", "a.csv", "--sim-answers-model", "gpt-4-1106-preview"],
                             environ={})
    assert cfg.model_name == "gpt-4-1106-preview"
