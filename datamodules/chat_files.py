"""Reading local JSON / JSONL chat files row by row, so one bad row costs that row, not the file.

``datasets``' JSON builder refuses a whole file for one invalid line or one non-UTF-8 byte, without
naming the line; it keeps the last of two equal keys without a word, and it fails on a file that mixes
string contents with lists of content parts (a bare pyarrow ``ArrowInvalid``). Here every line is
decoded and parsed on its own: a bad one (invalid JSON, not UTF-8, a key written twice in one object)
is counted as malformed with its file and line (or refused at once in strict mode), a UTF-8 byte-order
mark is read as one, and an empty file is an error that says so.

Each kept row is stored normalised (:func:`read_conversation`: OpenAI messages with string contents,
as JSON), so every row has one shape whatever form its file used; a row that does not normalise keeps
its place with the reason, which the tokenisation step counts and names by the row's line.
"""

from __future__ import annotations

import gzip
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
from datasets.fingerprint import Hasher

from lightning_drafts.datamodules.chat_format import (
    CONVERSATION_KEY,
    MALFORMED_FIELD_KEY,
    MALFORMED_KEY,
    MalformedRow,
    read_conversation,
)

# Bump when the parsing below changes what rows a file yields.
READER_VERSION = 3

BOM = b"\xef\xbb\xbf"


@dataclass
class ChatRows:
    """The rows read from some files, the malformed ones by reason, and where the first of each was."""

    rows: list[dict[str, Any]] = field(default_factory=list)
    # ``file:line`` (or ``file[i]``) of each kept row, for messages about rows found malformed later.
    where: list[str] = field(default_factory=list)
    malformed: Counter = field(default_factory=Counter)
    first_seen: dict[str, str] = field(default_factory=dict)

    def reject(self, reason: str, where: str, problem: str, strict: bool) -> None:
        if strict:
            raise ValueError(
                f"{where}: {problem} (strict mode stops at the first bad row; drop strict to skip it)"
            )
        self.malformed[reason] += 1
        self.first_seen.setdefault(reason, f"{where}: {problem}")


def read_chat_files(
    paths: list[Path], strict: bool = False, drop_media: bool = False
) -> tuple[datasets.Dataset, str, ChatRows]:
    """The rows of ``paths`` (``.json`` arrays or ``.jsonl``, optionally gzipped) as a dataset, a
    fingerprint of the files for the tokenisation cache, and what was rejected (``drop_media``: see
    :func:`read_conversation`)."""
    read = ChatRows()
    for path in paths:
        before = len(read.rows) + sum(read.malformed.values())
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rb") as handle:
            data = handle.read().removeprefix(BOM)
        if path.name.removesuffix(".gz").endswith(".jsonl"):
            _read_lines(path, data, read, strict, drop_media)
        else:
            _read_array(path, data, read, strict, drop_media)
        if len(read.rows) + sum(read.malformed.values()) == before:
            raise ValueError(f"data file {path} holds no rows; it is empty (or only blank lines)")
    if not read.rows:
        raise ValueError(
            f"no readable row in {[str(p) for p in paths]}: {dict(read.malformed)}; first: "
            f"{next(iter(read.first_seen.values()), '-')}"
        )
    stats = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in paths]
    fingerprint = Hasher.hash(["chat-files", READER_VERSION, stats, drop_media])
    return datasets.Dataset.from_list(read.rows), fingerprint, read


class _KeysTwice:
    """``json.loads`` ``object_pairs_hook``: builds objects as ``json`` does (the last value of a key
    wins) and remembers the keys an object held twice, in parse order."""

    def __init__(self) -> None:
        self.keys: list[str] = []

    def __call__(self, pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        built: dict[str, Any] = {}
        for key, value in pairs:
            if key in built:
                self.keys.append(key)
                built = _Twice(built)
                built.twice = key
            built[key] = value
        return built


class _Twice(dict):
    """An object that held the key ``twice`` more than once."""

    twice: str = ""


def _key_twice(node: Any) -> str | None:
    """The first key written twice in one object anywhere inside ``node``, or None."""
    if isinstance(node, _Twice):
        return node.twice
    children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
    for child in children:
        found = _key_twice(child)
        if found is not None:
            return found
    return None


def _refuse_keys_twice(key: str, where: str, read: ChatRows, strict: bool) -> None:
    read.reject(
        "key written twice",
        where,
        f"key {key!r} appears twice in one object; JSON readers keep one of the two values without a word, "
        "so write it once",
        strict,
    )


def _read_lines(path: Path, data: bytes, read: ChatRows, strict: bool, drop_media: bool) -> None:
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        where = f"{path}:{number}"
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            read.reject(
                "not UTF-8",
                where,
                f"byte {raw[error.start]:#04x} at column {error.start + 1} is not UTF-8",
                strict,
            )
            continue
        twice = _KeysTwice()
        try:
            row = json.loads(text, object_pairs_hook=twice)
        except json.JSONDecodeError as error:
            read.reject("invalid JSON", where, f"invalid JSON ({error.msg} at column {error.colno})", strict)
            continue
        if twice.keys:
            _refuse_keys_twice(twice.keys[0], where, read, strict)
            continue
        _keep(row, where, read, strict, drop_media)


def _read_array(path: Path, data: bytes, read: ChatRows, strict: bool, drop_media: bool) -> None:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise ValueError(
            f"{path}:{line}: byte {data[error.start]:#04x} is not UTF-8; re-encode the file"
        ) from error
    if not text.strip():
        return
    twice = _KeysTwice()
    try:
        rows = json.loads(text, object_pairs_hook=twice)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{path}:{error.lineno}: invalid JSON ({error.msg} at column {error.colno}); a .json file is one "
            "array of rows (write one row per line as .jsonl to have bad rows skipped instead)"
        ) from error
    if not isinstance(rows, list):
        raise ValueError(f"{path} holds a JSON {type(rows).__name__}; a .json data file is an array of rows")
    for index, row in enumerate(rows):
        key = _key_twice(row) if twice.keys else None
        if key is not None:
            _refuse_keys_twice(key, f"{path}[{index}]", read, strict)
            continue
        _keep(row, f"{path}[{index}]", read, strict, drop_media)


def _keep(row: Any, where: str, read: ChatRows, strict: bool, drop_media: bool) -> None:
    if not isinstance(row, dict):
        read.reject(
            "not a JSON object", where, f"a row must be a JSON object, got {type(row).__name__}", strict
        )
        return
    if "messages" not in row and "conversations" not in row:
        read.reject(
            "no messages field",
            where,
            f"no 'messages' or 'conversations' field (keys: {sorted(row)})",
            strict,
        )
        return
    try:
        # Answers may be empty here: regenerate writes them; training refuses them at tokenisation.
        conversation = read_conversation(row, require_answers=False, drop_media=drop_media)
        kept = {CONVERSATION_KEY: conversation.to_json(), MALFORMED_KEY: "", MALFORMED_FIELD_KEY: ""}
    except MalformedRow as malformed:
        kept = {CONVERSATION_KEY: "", MALFORMED_KEY: malformed.reason, MALFORMED_FIELD_KEY: malformed.field}
    read.rows.append(kept)
    read.where.append(where)
