"""Bad data files: every error names the file and the line, one bad row costs that row (unless strict),
and empty inputs say so."""

from __future__ import annotations

import json
import logging

import pytest

from lightning_drafts.datamodules import PackedChatDataModule
from lightning_drafts.datamodules.datamodule import logger as data_logger

GOOD = {
    "messages": [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello, friend"}]
}


def write_lines(path, lines: list[bytes]) -> str:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return str(path)


def data(files: str, tmp_path, **kwargs) -> PackedChatDataModule:
    module = PackedChatDataModule(
        data_files=files, max_tokens=256, cache_dir=str(tmp_path / "cache"), **kwargs
    )
    module.setup("fit")
    return module


def good_line() -> bytes:
    return json.dumps(GOOD).encode()


def test_an_invalid_json_line_and_a_non_utf8_line_cost_only_themselves(tmp_path, caplog):
    files = write_lines(
        tmp_path / "chats.jsonl",
        [
            good_line(),
            b'{"messages": [',
            good_line(),
            '{"messages": "caf\xe9"}'.encode("latin-1"),
            good_line(),
        ],
    )
    with caplog.at_level(logging.INFO, logger=data_logger.name):
        module = data(files, tmp_path)
    assert module.stats["train"]["documents"] == 3
    assert module.stats["train"]["malformed_reasons"] == {"invalid JSON": 1, "not UTF-8": 1}
    warning = next(r.getMessage() for r in caplog.records if "malformed rows skipped" in r.getMessage())
    assert f"{files}:2: invalid JSON" in warning
    assert f"{files}:4: byte 0xe9 at column" in warning


def test_strict_mode_stops_at_the_first_bad_row_and_names_it(tmp_path):
    files = write_lines(tmp_path / "chats.jsonl", [good_line(), good_line(), b"not json at all"])
    with pytest.raises(ValueError, match=r"chats.jsonl:3: invalid JSON .*strict mode"):
        data(files, tmp_path, strict=True)
    no_answer = {"messages": [{"role": "user", "content": "Anyone?"}]}
    files = write_lines(tmp_path / "unanswered.jsonl", [good_line(), json.dumps(no_answer).encode()])
    with pytest.raises(
        ValueError,
        match=r"unanswered.jsonl:2: no assistant turn \(field messages\[\*\]\.role\) \(strict mode",
    ):
        data(files, tmp_path, strict=True)


def test_an_empty_file_is_named(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match="data file .*empty.jsonl holds no rows"):
        data(str(empty), tmp_path)


def test_a_row_that_is_not_a_chat_is_named_with_its_fields(tmp_path, caplog):
    files = write_lines(tmp_path / "mixed.jsonl", [good_line(), b'{"text": "plain"}', b"[1, 2]"])
    with caplog.at_level(logging.INFO, logger=data_logger.name):
        module = data(files, tmp_path)
    assert module.stats["train"]["malformed_reasons"] == {"no messages field": 1, "not a JSON object": 1}
    warning = next(r.getMessage() for r in caplog.records if "malformed rows skipped" in r.getMessage())
    assert f"{files}:2: no 'messages' or 'conversations' field (keys: ['text'])" in warning


def test_a_json_array_file_with_a_syntax_error_names_its_line(tmp_path):
    path = tmp_path / "chats.json"
    path.write_text("[\n" + json.dumps(GOOD) + ",\n{oops}\n]\n")
    with pytest.raises(ValueError, match=r"chats.json:3: invalid JSON"):
        data(str(path), tmp_path)


def test_max_tokens_shorter_than_the_prompts_is_named(tmp_path):
    long_prompt = {
        "messages": [
            {"role": "user", "content": "word " * 80},
            {"role": "assistant", "content": "short answer"},
        ]
    }
    files = write_lines(tmp_path / "long.jsonl", [json.dumps(long_prompt).encode()] * 3)
    with pytest.raises(ValueError, match="every prompt fills max_tokens=32 .*raise max_tokens"):
        PackedChatDataModule(data_files=files, max_tokens=32, cache_dir=str(tmp_path / "cache")).setup("fit")


def chat(*turns: tuple[str, str]) -> dict:
    return {"messages": [{"role": role, "content": content} for role, content in turns]}


# Rows that parse as JSON but fail at tokenisation, each with the location and field it is named by.
TOKENISE_TIME_BAD = [
    (chat(("user", "Anyone?")), "no assistant turn (field messages[*].role)"),
    (chat(("user", "Hi"), ("bot", "Hello")), "unknown role 'bot' (field messages[1].role)"),
    (
        chat(("user", "Hi"), ("assistant", None)),
        "message content is not a string (field messages[1].content)",
    ),
]


def test_rows_malformed_at_tokenisation_are_named_by_file_line_and_field(tmp_path, caplog):
    # A blank line first: line numbers count the file's lines, not its rows.
    lines = [b"", good_line()] + [json.dumps(row).encode() for row, _ in TOKENISE_TIME_BAD]
    files = write_lines(tmp_path / "chats.jsonl", lines)
    with caplog.at_level(logging.INFO, logger=data_logger.name):
        module = data(files, tmp_path)
    assert module.stats["train"]["malformed"] == len(TOKENISE_TIME_BAD)
    warning = next(r.getMessage() for r in caplog.records if "malformed rows skipped" in r.getMessage())
    for line, (_, named) in enumerate(TOKENISE_TIME_BAD, start=3):
        assert f"{files}:{line}: {named}" in warning, warning
    with pytest.raises(ValueError, match=r"chats.jsonl:3: no assistant turn .*strict mode stops"):
        data(files, tmp_path, strict=True)


def test_only_the_first_rows_of_a_reason_are_named(tmp_path, caplog):
    unanswered = json.dumps(chat(("user", "Anyone?"))).encode()
    files = write_lines(tmp_path / "chats.jsonl", [good_line()] + [unanswered] * 5)
    with caplog.at_level(logging.INFO, logger=data_logger.name):
        data(files, tmp_path)
    warning = next(r.getMessage() for r in caplog.records if "malformed rows skipped" in r.getMessage())
    assert [f"{files}:{n}: no assistant turn" in warning for n in range(2, 7)] == [True] * 3 + [False] * 2


def test_parquet_rows_malformed_at_tokenisation_are_named_by_row_index(tmp_path, caplog):
    import datasets

    path = tmp_path / "chats.parquet"
    rows = [GOOD, chat(("user", "Hi"), ("bot", "Hello")), GOOD]
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    with caplog.at_level(logging.INFO, logger=data_logger.name):
        data(str(path), tmp_path)
    warning = next(r.getMessage() for r in caplog.records if "malformed rows skipped" in r.getMessage())
    assert f"{path} row 1: unknown role 'bot' (field messages[1].role)" in warning


def test_rows_of_a_file_read_row_by_row_keep_their_lines(tmp_path, caplog):
    # The invalid JSON line sends the file through the row-by-row reader; the later row still has its line.
    unanswered = json.dumps(chat(("user", "Anyone?"))).encode()
    files = write_lines(tmp_path / "chats.jsonl", [good_line(), b"{oops", good_line(), unanswered])
    with caplog.at_level(logging.INFO, logger=data_logger.name):
        data(files, tmp_path)
    warning = next(r.getMessage() for r in caplog.records if "malformed rows skipped" in r.getMessage())
    assert f"{files}:2: invalid JSON" in warning and f"{files}:4: no assistant turn" in warning


# Roles a lenient template (ChatML) renders without a word and a strict one (Mistral's) refuses at
# serving, each with the order it is named by.
OUT_OF_ORDER = [
    (
        chat(("user", "Hi"), ("user", "Still there?"), ("assistant", "Yes")),
        "user after user",
        "messages[1].role",
    ),
    (
        chat(("assistant", "Welcome"), ("user", "Hi"), ("assistant", "Hello")),
        "assistant first",
        "messages[0].role",
    ),
    (chat(("system", "Be brief"), ("assistant", "Hello")), "assistant first", "messages[1].role"),
    (
        chat(("user", "Hi"), ("assistant", "Hello"), ("assistant", "Again")),
        "assistant after assistant",
        "messages[2].role",
    ),
    (
        chat(("user", "Hi"), ("system", "Be brief"), ("assistant", "Hello")),
        "system after user",
        "messages[1].role",
    ),
    (
        {
            "conversations": [
                {"from": "gpt", "value": "Welcome"},
                {"from": "human", "value": "Hi"},
                {"from": "gpt", "value": "Yo"},
            ]
        },
        "assistant first",
        "conversations[0].from",
    ),
]


def test_roles_out_of_order_are_refused_naming_file_line_and_order(tmp_path, caplog):
    in_order = chat(("system", "Be brief"), ("user", "Hi"), ("assistant", "Hello"), ("user", "Bye"))
    lines = [good_line(), json.dumps(in_order).encode()] + [
        json.dumps(row).encode() for row, *_ in OUT_OF_ORDER
    ]
    files = write_lines(tmp_path / "chats.jsonl", lines)
    with caplog.at_level(logging.INFO, logger=data_logger.name):
        module = data(files, tmp_path, chat_template="chatml")
    assert module.stats["train"]["documents"] == 2
    assert module.stats["train"]["malformed"] == len(OUT_OF_ORDER)
    warning = next(r.getMessage() for r in caplog.records if "malformed rows skipped" in r.getMessage())
    for line, (_, order, field) in enumerate(OUT_OF_ORDER, start=3):
        assert f"{files}:{line}: roles out of order: {order} (field {field})" in warning, warning
    with pytest.raises(ValueError) as refused:
        data(files, tmp_path, chat_template="chatml", strict=True)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(f"{files}:3: roles out of order: user after user (field messages[1].role)")


def test_a_model_folder_without_tokenizer_files_is_named_with_what_to_pass(tmp_path):
    from lightning_drafts.shipped import shipped_target_path

    weights_only = tmp_path / "model"
    weights_only.mkdir()
    (weights_only / "config.json").write_text((shipped_target_path("tiny-llama") / "config.json").read_text())
    with pytest.raises(ValueError) as refused:
        PackedChatDataModule(tokenizer=str(weights_only), cache_dir=str(tmp_path / "cache"))
    message = str(refused.value)
    assert message.startswith(
        f"tokenizer={str(weights_only)!r}: the folder {weights_only} has no tokenizer files ("
    )
    assert "it holds config.json); pass the folder or hub id the model's tokenizer came with" in message
    assert "sentencepiece or tiktoken installed" not in message and "\n" not in message
    # The same folder with the tokenizer's files loads.
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (weights_only / name).write_bytes((shipped_target_path("tiny-llama") / name).read_bytes())
    assert (
        PackedChatDataModule(tokenizer=str(weights_only), cache_dir=str(tmp_path / "cache")).vocab_size
        == 2048
    )


def test_a_directory_as_data_files_names_the_glob_to_pass(tmp_path):
    folder = tmp_path / "chats"
    folder.mkdir()
    for name in ("a.jsonl", "b.jsonl", "c.json"):
        write_lines(folder / name, [good_line()])
    with pytest.raises(ValueError) as refused:
        data(str(folder), tmp_path)
    assert str(refused.value) == (
        f"data file {str(folder)!r} is a directory (it holds 2 .jsonl files, 1 .json file); pass its files with "
        f"a glob, data_files: {str(folder / '*.jsonl')!r}, or a list of files"
    )
    # The glob it names reads them.
    assert data(str(folder / "*.jsonl"), tmp_path).stats["train"]["documents"] == 2
