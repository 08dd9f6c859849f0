"""Every message shape of the OpenAI chat format and ShareGPT through the data path ``fit`` uses (setup,
then a batch of the train loader), rendered by Qwen3's published template: what is supervised, what is
refused with its row and field, and what the setup summary counts."""

from __future__ import annotations

import logging

import datasets
import pytest

from lightning_drafts.core.batch import validate_batch
from lightning_drafts.datamodules import PackedChatDataModule
from lightning_drafts.datamodules.chat_format import conversation_row, read_conversation
from lightning_drafts.datamodules.datamodule import logger as data_logger
from tests.support.chat_templates import (
    WEATHER_TOOL,
    family_tokenizer,
    set_up,
    supervised_runs,
    template,
    write_jsonl,
)

QUESTION = {"role": "user", "content": "Weather in Paris?"}
CALL = {
    "id": "call1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
RESULT = {"role": "tool", "tool_call_id": "call1", "content": "18 C, sunny"}
ANSWER = {"role": "assistant", "content": "It is sunny."}
QWEN3_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'
EMPTY_THINK = "<think>\n\n</think>\n\n"

# (row, the supervised runs of each of its documents), written by hand from Qwen3's template.
SHAPES = {
    "system": (
        {"messages": [{"role": "system", "content": "Be brief."}, QUESTION, ANSWER]},
        [[EMPTY_THINK + "It is sunny.<|im_end|>"]],
    ),
    "developer": (
        {"messages": [{"role": "developer", "content": "Be brief."}, QUESTION, ANSWER]},
        [[EMPTY_THINK + "It is sunny.<|im_end|>"]],
    ),
    "content parts": (
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": "Paris?"}],
                },
                {"role": "assistant", "content": [{"type": "text", "text": "It is sunny."}]},
            ]
        },
        [[EMPTY_THINK + "It is sunny.<|im_end|>"]],
    ),
    # The call's turn is the last one of its own document (Qwen3 writes an empty think block for the
    # last turn only), the answer's turn of the next: the tool result is in the second, unsupervised.
    "tool call and result": (
        {
            "tools": [WEATHER_TOOL],
            "messages": [
                QUESTION,
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                RESULT,
                ANSWER,
            ],
        },
        [[EMPTY_THINK + QWEN3_CALL], [EMPTY_THINK + "It is sunny.<|im_end|>"]],
    ),
    "reasoning_content": (
        {"messages": [QUESTION, {**ANSWER, "reasoning_content": "Look it up."}]},
        [["<think>\nLook it up.\n</think>\n\nIt is sunny.<|im_end|>"]],
    ),
    "think block in content": (
        {"messages": [QUESTION, {"role": "assistant", "content": "<think>Look it up.</think>It is sunny."}]},
        [["<think>\nLook it up.\n</think>\n\nIt is sunny.<|im_end|>"]],
    ),
    "sharegpt tool call": (
        {
            "tools": '[{"type": "function", "function": {"name": "get_weather"}}]',
            "conversations": [
                {"from": "human", "value": "Weather in Paris?"},
                {"from": "function_call", "value": '{"name": "get_weather", "arguments": {"city": "Paris"}}'},
                {"from": "observation", "value": "18 C, sunny"},
                {"from": "gpt", "value": "It is sunny."},
            ],
        },
        [[EMPTY_THINK + QWEN3_CALL], [EMPTY_THINK + "It is sunny.<|im_end|>"]],
    ),
}


def batch_runs(module) -> list[list[str]]:
    """The supervised runs of every document of one train batch (packing off: a row per document)."""
    batch = validate_batch(next(iter(module.train_dataloader())), module.vocab_size).to_dict()
    found = []
    for row in range(batch["input_ids"].shape[0]):
        real = batch["attention_mask"][row].bool()
        ids, mask = batch["input_ids"][row][real].tolist(), batch["loss_mask"][row][real].tolist()
        runs, current = [], []
        for token, supervised in zip([*ids, -1], [*mask, 0], strict=True):
            if supervised:
                current.append(token)
            elif current:
                runs.append(module.tokenizer.decode(current))
                current = []
        found.append(runs)
    return found


@pytest.mark.parametrize("shape", list(SHAPES))
def test_each_shape_is_supervised_where_the_target_speaks(shape, tmp_path):
    row, expected = SHAPES[shape]
    module = set_up([row], tmp_path, "qwen3", packing=False, batch_size=len(expected))
    assert module.stats["train"]["malformed"] == 0
    assert [supervised_runs(module, i) for i in range(len(module.train_documents))] == expected
    assert sorted(batch_runs(module)) == sorted(expected)


def test_developer_reads_as_system_for_a_template_without_the_role(tmp_path):
    system = set_up([SHAPES["system"][0]], tmp_path / "system", "qwen3")
    developer = set_up([SHAPES["developer"][0]], tmp_path / "developer", "qwen3")
    assert system.train_documents.tokens(0)[0].tolist() == developer.train_documents.tokens(0)[0].tolist()


def test_tool_definitions_reach_the_template_unsupervised(tmp_path):
    module = set_up([SHAPES["tool call and result"][0]], tmp_path, "qwen3")
    ids, mask = module.train_documents.tokens(1)
    text = module.tokenizer.decode(ids.tolist())
    assert (
        '{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city"' in text
    )
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in text
    assert "18 C" not in module.tokenizer.decode(ids[mask == 1].tolist())


BAD = [
    (
        {"messages": [QUESTION, RESULT, ANSWER]},
        "roles out of order: tool result without a tool call before it",
        "messages[1].role",
    ),
    (
        {
            "messages": [
                QUESTION,
                {"role": "assistant", "content": "", "tool_calls": [CALL]},
                {**RESULT, "tool_call_id": "call9"},
                ANSWER,
            ]
        },
        "tool result for call id 'call9', which the turn before does not make",
        "messages[2].tool_call_id",
    ),
    (
        {
            "messages": [
                QUESTION,
                {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{city"}}]},
            ]
        },
        "tool call arguments are not JSON",
        "messages[1].tool_calls[0].function.arguments",
    ),
    (
        {"messages": [QUESTION, {"role": "assistant", "tool_calls": [{"function": {}}]}]},
        "tool call without a function name",
        "messages[1].tool_calls[0].function.name",
    ),
    ({"tools": {"name": "f"}, "messages": [QUESTION, ANSWER]}, "tools is not a list of objects", "tools"),
]


def test_malformed_tool_shapes_are_named_by_line_and_field(tmp_path, caplog):
    good = {"messages": [QUESTION, ANSWER]}
    files = write_jsonl(tmp_path / "chats.jsonl", [good] + [row for row, _, _ in BAD])
    module = PackedChatDataModule(
        data_files=files,
        tokenizer=family_tokenizer("qwen3"),
        chat_template=template("qwen3"),
        cache_dir=str(tmp_path / "c"),
    )
    with caplog.at_level(logging.INFO, logger=data_logger.name):
        module.setup("fit")
    assert module.stats["train"]["documents"] == 1 and module.stats["train"]["malformed"] == len(BAD)
    warning = next(r.getMessage() for r in caplog.records if "malformed rows skipped" in r.getMessage())
    for line, (_, reason, field) in enumerate(BAD, start=2):
        assert f"{files}:{line}: {reason}" in warning and f"(field {field})" in warning


def test_media_parts_are_dropped_and_counted_when_asked(tmp_path, caplog):
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    row = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Look:"}, image]}, ANSWER]}
    refused = set_up([row, {"messages": [QUESTION, ANSWER]}], tmp_path / "refused", "qwen3")
    assert refused.stats["train"]["malformed_reasons"] == {
        "content part of type 'image_url': only text parts can be trained on (drop_media=True drops them and "
        "counts them)": 1
    }
    with caplog.at_level(logging.INFO, logger=data_logger.name):
        module = set_up([row, row], tmp_path, "qwen3", drop_media=True)
    assert module.stats["train"]["documents"] == 2 and module.stats["train"]["media_dropped"] == 2
    text = module.tokenizer.decode(module.train_documents.tokens(0)[0].tolist())
    assert "<|im_start|>user\nLook:<|im_end|>" in text


def test_the_summary_line_counts_tool_calls_results_and_reasoning(tmp_path, caplog):
    rows = [SHAPES["tool call and result"][0], SHAPES["reasoning_content"][0]]
    with caplog.at_level(logging.DEBUG, logger=data_logger.name):
        module = set_up(rows, tmp_path, "qwen3", supervise_reasoning=False)
    counts = module.stats["train"]
    # The reasoning as the template writes it, tags included, tokenised on its own.
    reasoning = len(module.tokenizer("<think>\nLook it up.\n</think>", add_special_tokens=False)["input_ids"])
    # The tool-call turns' empty think blocks hold no reasoning text: only "Look it up." counts.
    assert (counts["tool_calls"], counts["tool_results"]) == (1, 1)
    assert (counts["reasoning_tokens"], counts["reasoning_supervised"]) == (reasoning, 0)
    line = next(
        r.getMessage() for r in caplog.records if r.getMessage().startswith("train split: 3 documents")
    )
    assert (
        f"1 tool calls (supervised), 1 tool results (not supervised), {reasoning} reasoning tokens (0 supervised, {reasoning} not)"
        in line
    )


def test_parquet_rows_of_mixed_shapes_train_as_their_jsonl_copies(tmp_path):
    # Arrow gives every message every key of every other message (None where absent) and every row a
    # tools column: the absent keys must stay absent for the template.
    rows = [SHAPES[name][0] for name in ("tool call and result", "system", "reasoning_content")]
    path = tmp_path / "rows.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    parquet = PackedChatDataModule(
        data_files=str(path),
        tokenizer=family_tokenizer("qwen3"),
        chat_template=template("qwen3"),
        cache_dir=str(tmp_path / "c"),
    )
    parquet.setup("fit")
    jsonl = set_up(rows, tmp_path / "jsonl", "qwen3")
    assert parquet.stats["train"]["malformed"] == 0
    assert [parquet.train_documents.tokens(i)[0].tolist() for i in range(len(parquet.train_documents))] == [
        jsonl.train_documents.tokens(i)[0].tolist() for i in range(len(jsonl.train_documents))
    ]


@pytest.mark.parametrize("name", ["reasoning_content", "reasoning", "thinking"])
def test_reasoning_under_any_of_its_names_and_absent_keys_stay_absent(name):
    row = {
        "messages": [
            QUESTION,
            {"role": "assistant", "content": None, name: "Look.", "tool_calls": [CALL]},
            RESULT,
        ]
    }
    assert read_conversation(row).messages == [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "type": "function",
                    "id": "call1",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
            "reasoning_content": "Look.",
        },
        {"role": "tool", "content": "18 C, sunny", "tool_call_id": "call1"},
    ]


def test_a_sharegpt_function_call_may_hold_several_calls():
    calls = '[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": "{\\"y\\": 2}"}]'
    row = {"conversations": [{"from": "human", "value": "Go"}, {"from": "function_call", "value": calls}]}
    (_, turn) = read_conversation(row, require_answers=False).messages
    assert turn["tool_calls"] == [
        {"type": "function", "function": {"name": "a", "arguments": {"x": 1}}},
        {"type": "function", "function": {"name": "b", "arguments": {"y": 2}}},
    ]


def test_a_row_written_back_reads_as_the_same_conversation_in_its_input_format():
    """``conversation_row`` (how ``regenerate`` writes rows) gives every shape back in the format it came
    in: a canonical ShareGPT row is written back as it was, character for character, and each shape above
    and each of several calls reads back as the conversation it was read as."""
    sharegpt = SHAPES["sharegpt tool call"][0]
    assert conversation_row(read_conversation(sharegpt)) == sharegpt
    several = {
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "Go"},
            {
                "from": "function_call",
                "value": '[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]',
            },
            {"from": "observation", "value": "1", "name": "a"},
            {"from": "observation", "value": "2"},
            {"from": "gpt", "value": "Done.", "reasoning_content": "Both ran."},
            {"from": "human", "value": "And Paris?"},
            {"from": "gpt", "value": "Looking.", "tool_calls": [CALL]},
            {"from": "observation", "value": "18 C", "tool_call_id": "call1"},
            {"from": "gpt", "value": "Sunny."},
        ]
    }
    rows = [several, *(row for row, _ in SHAPES.values())]
    for row in rows:
        conversation = read_conversation(row, require_answers=False)
        written = conversation_row(conversation)
        assert set(written) <= {"messages", "conversations", "tools"}
        assert ("conversations" in written) == ("conversations" in row), written
        assert read_conversation(written, require_answers=False) == conversation, row
