"""`evaluate` on a prompt set: MT-Bench's second turn is asked after the target's own greedy answer to the
first, both turns are served, and the results are split per category with the set's overall row; from the
CLI (`evaluate --prompts mt-bench --num-prompts 2`, the quickstart config) the table lands in `--out` and
in the export's model card.

The export is an EAGLE-3 draft briefly trained against the quickstart's target (shipped:tiny-llama), so
rounds accept some drafted tokens and reject others."""

from __future__ import annotations

import json
from collections import Counter
from importlib import resources
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from lightning_drafts.cli.main import main
from lightning_drafts.serving.conversation_prompts import turn_prompt
from lightning_drafts.serving.decode import greedy_generate
from lightning_drafts.serving.prompt_sets import Conversation, load_prompt_set
from lightning_drafts.serving.served_table import ServedRequest
from lightning_drafts.shipped import resolve_shipped
from lightning_drafts.training.target import FrozenTarget
from lightning_drafts.workflows.evaluate import evaluate_export
from lightning_drafts.workflows.export import export_module
from tests.serving.vllm_cases import TARGETS, TRAIN_STEPS, trained_module

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "configs" / "quickstart" / "eagle3.yaml"
TARGET = TARGETS["llama"]  # the quickstart's target
STOP = [2]  # the shipped tokenizer's <|im_end|>, the targets' eos_token_id


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    """The draft exported as `lightning-drafts export` writes it: serving files and the model card."""
    return export_module(
        trained_module("eagle3", TARGET, TRAIN_STEPS["eagle3"]), tmp_path_factory.mktemp("e") / "x"
    )


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_shipped(TARGET))


def test_the_second_turn_holds_the_first_answer(tokenizer):
    conversation = Conversation("mt-bench", "writing", "81", ("Write a poem.", "Now shorter."))
    answer = tokenizer("roses are red", add_special_tokens=False)["input_ids"] + STOP
    prompt = tokenizer.decode(turn_prompt(tokenizer, conversation, [answer], STOP).tolist())
    # The chat as the template writes it: question, the answer (its stop token closed by the template),
    # the next question, and the assistant's turn opened.
    assert prompt == (
        "<|im_start|>user\nWrite a poem.<|im_end|>\n<|im_start|>assistant\nroses are red<|im_end|>\n"
        "<|im_start|>user\nNow shorter.<|im_end|>\n<|im_start|>assistant\n"
    )
    first = tokenizer.decode(turn_prompt(tokenizer, conversation, [], STOP).tolist())
    assert first == "<|im_start|>user\nWrite a poem.<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="has 2 turns; there is no turn 3"):
        turn_prompt(tokenizer, conversation, [answer, answer], STOP)


def test_mt_bench_turns_follow_the_targets_answers_and_split_by_category(export, tokenizer):
    conversations = load_prompt_set("mt-bench", 3)
    report = evaluate_export(
        export, conversations, target=TARGET, tokenizer=tokenizer, max_new_tokens=6, check_lossless=True
    )
    assert report.lossless is True
    assert report.requests == [
        ServedRequest("mt-bench", c.category, c.question_id, turn) for turn in (1, 2) for c in conversations
    ]
    # The reference: turn 1 rendered, the target's own greedy answer, turn 2 rendered after it.
    target = FrozenTarget(TARGET, attn_backend="sdpa")
    for index, conversation in enumerate(conversations):
        first = turn_prompt(tokenizer, conversation, [], STOP)
        answer = greedy_generate(target, first, 6, STOP)
        second = turn_prompt(tokenizer, conversation, [answer], STOP)
        assert report.prompts[index] == first.tolist()
        assert report.prompts[index + 3] == second.tolist()
        assert report.generations[index] == answer

    rows = {row.category: row for row in report.table}
    assert list(rows) == ["writing", "roleplay", "reasoning", "all"]
    for category, row in rows.items():
        members = [i for i, r in enumerate(report.requests) if category in ("all", r.category)]
        rounds = [report.accepted[i] for i in members]
        assert row.requests == len(members) == (6 if category == "all" else 2)
        assert row.output_tokens == sum(len(report.generations[i]) for i in members)
        assert row.accept_len_pooled == pytest.approx(1 + sum(map(sum, rounds)) / sum(map(len, rounds)))
        assert row.accept_len_per_request == pytest.approx(
            sum(1 + sum(r) / len(r) for r in rounds) / len(rounds)
        )
        assert row.tokens_per_s["draft"] > 0 and row.tokens_per_s["target"] > 0
        assert row.tokens_per_s["ngram"] is None  # vLLM's, not measured by the built-in decode
    assert report.served.accept_len == pytest.approx(rows["all"].accept_len_pooled)
    assert report.served.accept_len_per_request == pytest.approx(rows["all"].accept_len_per_request)
    # Not a trivial agreement: some rounds accept drafted tokens, others reject them.
    counts = [a for request in report.accepted for a in request]
    assert 0 < sum(c > 0 for c in counts) < len(counts), counts
    assert report.training is not None and report.training.accept_len is not None  # tau_sim kept


def test_cli_evaluate_mt_bench_writes_the_table_and_the_card(export, tmp_path, capsys):
    out = tmp_path / "results"
    main(
        ["evaluate", str(export), f"--config={QUICKSTART}", "--prompts", "mt-bench", "--num-prompts", "2"]
        + ["--max-new-tokens", "4", "--out", str(out)]
    )
    printed = capsys.readouterr().out
    assert "accept_len pooled" in printed and "accept_len per-request" in printed and "tau_sim" in printed
    report = json.loads((out / "served.json").read_text())
    assert [(r["category"], r["turn"]) for r in report["requests"]] == [
        ("writing", 1),
        ("roleplay", 1),
        ("writing", 2),
        ("roleplay", 2),
    ]
    assert [(r["category"], r["requests"]) for r in report["table"]] == [
        ("writing", 2),
        ("roleplay", 2),
        ("all", 4),
    ]
    assert report["speed_engine"] == "the built-in decode on CPU (batch of one, no KV cache)"
    table = (out / "served.md").read_text()
    card = (export / "README.md").read_text()
    for row in report["table"]:
        line = f"| mt-bench | {row['category']} | {row['requests']} | {row['output_tokens']} | "
        assert line in table and line in card
    assert "| served `accept_len`, per-request mean (SpecForge) |" in card
    assert "the shipped `mt-bench` set" in card
    assert torch.tensor(report["prompts"][2]).numel() > torch.tensor(report["prompts"][0]).numel()


@pytest.mark.parametrize(
    ("name", "file", "text", "categories", "table"),
    [
        ("gsm8k", "gsm8k.jsonl", "question", ["math", "math"], [("math", 2)]),
        # Round-robin over the subjects: the first problem of each of the first two subjects in the file.
        (
            "math-500",
            "math500.jsonl",
            "problem",
            ["Precalculus", "Intermediate Algebra"],
            [("Precalculus", 1), ("Intermediate Algebra", 1), ("all", 2)],
        ),
    ],
)
def test_cli_evaluate_serves_the_math_sets_questions(
    export, tmp_path, tokenizer, name, file, text, categories, table
):
    out = tmp_path / "results"
    main(
        ["evaluate", str(export), f"--config={QUICKSTART}", "--prompts", name, "--num-prompts", "2"]
        + ["--max-new-tokens", "2", "--no-card", "--out", str(out)]
    )
    report = json.loads((out / "served.json").read_text())
    assert [r["category"] for r in report["requests"]] == categories
    assert [(r["category"], r["requests"]) for r in report["table"]] == table
    data = resources.files("lightning_drafts.shipped").joinpath("prompt_data", file).read_text()
    rows = [json.loads(line) for line in data.splitlines()]
    # The n-th request of a category is that category's n-th row of the file.
    taken: Counter[str] = Counter()
    expected = []
    for category in categories:
        expected.append(
            [row[text] for row in rows if row.get("subject", "math") == category][taken[category]]
        )
        taken[category] += 1
    # The chat-templated prompt holds the question as the user wrote it, and none of its solution.
    for prompt, question in zip(report["prompts"], expected, strict=True):
        rendered = tokenizer.decode(prompt)
        assert question in rendered and "####" not in rendered and "\\boxed" not in rendered, rendered


def test_cli_evaluate_samples_when_given_a_temperature(export, tmp_path, capsys):
    def run(out: Path, *extra: str) -> dict:
        main(
            ["evaluate", str(export), f"--config={QUICKSTART}", "--prompts", "mt-bench", "--num-prompts", "1"]
            + [
                "--max-new-tokens",
                "6",
                "--temperature",
                "0.7",
                "--top-p",
                "0.9",
                "--no-card",
                "--out",
                str(out),
            ]
            + list(extra)
        )
        return json.loads((out / "served.json").read_text())

    first, again = run(tmp_path / "a"), run(tmp_path / "b")
    assert first["sampling"] == {"temperature": 0.7, "top_p": 0.9}
    assert "sampled at temperature 0.7, top_p 0.9" in (tmp_path / "a" / "served.md").read_text()
    assert first["generations"] == again["generations"]  # request i draws from seed + i
    assert len(first["generations"]) == 2 and all(len(g) >= 1 for g in first["generations"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as failure:
        main(
            [
                "evaluate",
                str(export),
                f"--config={QUICKSTART}",
                "--prompts",
                "mt-bench",
                "--temperature",
                "0.7",
            ]
            + ["--check-lossless", "--num-prompts", "1"]
        )
    assert failure.value.code == 2
    assert "a sampled decode matches the target's distribution, not its tokens" in capsys.readouterr().err
