"""Chat files in the forms users have: OpenAI content parts, a byte-order mark, keys written twice, empty
answers. Each is read as written or refused by file, line and field, never taken silently."""

from __future__ import annotations

import json
import logging

import datasets
import numpy as np
import pytest

from lightning_drafts.datamodules import PackedChatDataModule
from lightning_drafts.datamodules.datamodule import logger as data_logger


def chat(user, assistant) -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]}


def text_parts(*texts: str) -> list[dict]:
    return [{"type": "text", "text": text} for text in texts]


def write_jsonl(path, rows: list) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def setup(files, tmp_path, caplog=None, **kwargs) -> PackedChatDataModule:
    module = PackedChatDataModule(
        data_files=files, max_tokens=256, cache_dir=str(tmp_path / "cache"), **kwargs
    )
    if caplog is None:
        module.setup("fit")
    else:
        with caplog.at_level(logging.INFO, logger=data_logger.name):
            module.setup("fit")
    return module


def documents(module: PackedChatDataModule) -> list[list[int]]:
    docs = module.train_documents
    return [docs.tokens(i)[0].tolist() for i in range(len(docs))]


def malformed_warning(caplog) -> str:
    return next(r.getMessage() for r in caplog.records if "malformed rows skipped" in r.getMessage())


def test_text_parts_are_joined_with_newlines_in_a_file_that_mixes_both_forms(tmp_path):
    parts = [
        chat(text_parts("What is", "two plus two?"), "Four."),
        chat("Hi", text_parts("Hello", "friend")),
    ]
    strings = [chat("What is\ntwo plus two?", "Four."), chat("Hi", "Hello\nfriend")]
    # String contents and lists of parts in one file: datasets' JSON builder fails on it (ArrowInvalid).
    mixed = setup(write_jsonl(tmp_path / "mixed.jsonl", [strings[0], parts[1], parts[0]]), tmp_path)
    reference = setup(write_jsonl(tmp_path / "strings.jsonl", [strings[0], strings[1], strings[0]]), tmp_path)
    assert mixed.stats["train"]["malformed"] == 0
    assert documents(mixed) == documents(reference)
    ids, mask = mixed.train_documents.tokens(1)
    assert mixed.tokenizer.decode(ids[mask == 1]).strip().startswith("Hello\nfriend")


def test_text_parts_of_a_parquet_file_are_joined(tmp_path):
    path = tmp_path / "parts.parquet"
    datasets.Dataset.from_list([chat(text_parts("Hi", "there"), text_parts("Hello"))]).to_parquet(str(path))
    module = setup(str(path), tmp_path)
    reference = setup(write_jsonl(tmp_path / "strings.jsonl", [chat("Hi\nthere", "Hello")]), tmp_path)
    assert documents(module) == documents(reference)


def test_a_part_that_is_not_text_is_refused_by_file_line_and_field(tmp_path, caplog):
    image = {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}
    rows = [chat("Hi", "Hello"), chat([*text_parts("Look:"), image], "A cat."), chat("Hi", "Hello")]
    files = write_jsonl(tmp_path / "chats.jsonl", rows)
    module = setup(files, tmp_path, caplog)
    assert module.stats["train"]["documents"] == 2 and module.stats["train"]["malformed"] == 1
    assert f"{files}:2: content part of type 'image_url'" in malformed_warning(caplog)
    assert "(field messages[0].content[1].type)" in malformed_warning(caplog)
    with pytest.raises(ValueError, match=r"chats.jsonl:2: content part of type 'image_url'.*strict"):
        setup(files, tmp_path, strict=True)


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_byte_order_mark_is_read_as_one(suffix, tmp_path):
    rows = [chat("Hi", f"Hello {i}") for i in range(3)]
    path = tmp_path / f"bom{suffix}"
    body = json.dumps(rows) if suffix == ".json" else "".join(json.dumps(r) + "\n" for r in rows)
    # A later bad line too: it used to send the file to the reader that took the mark for bad JSON.
    tail = "" if suffix == ".json" else "{oops\n"
    path.write_bytes(b"\xef\xbb\xbf" + (body + tail).encode())
    module = setup(str(path), tmp_path)
    reference = setup(write_jsonl(tmp_path / "plain.jsonl", rows), tmp_path)
    assert documents(module) == documents(reference)
    assert module.stats["train"]["malformed_reasons"] == ({} if suffix == ".json" else {"invalid JSON": 1})


def test_a_key_written_twice_is_refused_naming_the_key_and_the_row(tmp_path, caplog):
    good = json.dumps(chat("Hi", "Hello"))
    twice = '{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "A", "content": "B"}]}'
    path = tmp_path / "chats.jsonl"
    path.write_text(f"{good}\n{twice}\n{good}\n")
    module = setup(str(path), tmp_path, caplog)
    assert module.stats["train"]["documents"] == 2
    assert module.stats["train"]["malformed_reasons"] == {"key written twice": 1}
    assert f"{path}:2: key 'content' appears twice in one object" in malformed_warning(caplog)
    with pytest.raises(ValueError, match=r"chats.jsonl:2: key 'content' appears twice.*strict"):
        setup(str(path), tmp_path, strict=True)
    array = tmp_path / "chats.json"
    array.write_text(f'[{good}, {good}, {{"messages": [], "messages": null}}]')
    caplog.clear()
    module = setup(str(array), tmp_path, caplog)
    assert module.stats["train"]["documents"] == 2
    assert f"{array}[2]: key 'messages' appears twice" in malformed_warning(caplog)


@pytest.mark.parametrize("answer", ["", "  \n"])
def test_an_empty_answer_is_skipped_counted_and_named(answer, tmp_path, caplog):
    rows = [chat("Hi", "Hello"), chat("Anyone?", answer), chat("Hi", "Hello")]
    files = write_jsonl(tmp_path / "chats.jsonl", rows)
    module = setup(files, tmp_path, caplog)
    assert module.stats["train"]["documents"] == 2
    assert module.stats["train"]["malformed_reasons"] == {"empty assistant answer": 1}
    assert f"{files}:2: empty assistant answer (field messages[1].content)" in malformed_warning(caplog)
    with pytest.raises(ValueError, match=r"chats.jsonl:2: empty assistant answer"):
        setup(files, tmp_path, strict=True)
    # regenerate writes the answers, so it still gets the conversation.
    regenerated = dict(PackedChatDataModule(data_files=files, cache_dir=str(tmp_path / "c2")).conversations())
    assert regenerated[1][1] == {"role": "assistant", "content": answer}


def test_each_malformed_row_is_named_once_and_only_by_us(tmp_path, caplog, capsys):
    rows = [chat("Hi", "Hello"), {"messages": [{"role": "user", "content": "Anyone?"}]}]
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "{oops\n")
    with caplog.at_level(logging.INFO):
        module = setup(str(path), tmp_path)
        module.prepare_data()  # the Trainer's order: prepare_data, then setup, each reading the source
        module.train_documents = None
        module.setup("fit")
    warnings = [r.getMessage() for r in caplog.records if "malformed rows skipped" in r.getMessage()]
    assert warnings and all(w.count(f"{path}:2: no assistant turn") == 1 for w in warnings)
    assert all(w.count(f"{path}:3: invalid JSON") == 1 for w in warnings)
    everything = " ".join(r.getMessage() for r in caplog.records) + "".join(capsys.readouterr())
    assert "Failed to load JSON" not in everything and "row 2" not in everything


def test_a_glob_that_matches_nothing_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"pattern '.*nothing-\*\.jsonl' matches no file"):
        setup(str(tmp_path / "nothing-*.jsonl"), tmp_path)


def test_rows_of_one_file_in_both_formats_keep_all_their_turns(tmp_path):
    # A table built from rows as written takes its columns from the first row: a ShareGPT row after an
    # OpenAI one lost its conversation there (the bad line sent the file to that reader).
    sharegpt = {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"}]}
    files = write_jsonl(tmp_path / "both.jsonl", [chat("Hi", "Hello"), sharegpt])
    with open(files, "a") as handle:
        handle.write("{oops\n")
    module = setup(files, tmp_path)
    assert module.stats["train"]["malformed_reasons"] == {"invalid JSON": 1}
    first, second = documents(module)
    assert first == second and np.asarray(first).size > 0
