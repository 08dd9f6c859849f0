"""Reading local JSON / JSONL chat files row by row, so one bad row costs that row, not the file.

``datasets``' JSON builder refuses a whole file for one invalid line or one non-UTF-8 byte, without
naming the line. Here every line is decoded and parsed on its own: a bad one is counted as malformed
with its file and line (or refused at once in strict mode), and an empty file is an error that says so.
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

# Bump when the parsing below changes what rows a file yields.
READER_VERSION = 1


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


def read_chat_files(paths: list[Path], strict: bool = False) -> tuple[datasets.Dataset, str, ChatRows]:
    """The rows of ``paths`` (``.json`` arrays or ``.jsonl``, optionally gzipped) as a dataset, a
    fingerprint of the files for the tokenisation cache, and what was rejected."""
    read = ChatRows()
    for path in paths:
        before = len(read.rows) + sum(read.malformed.values())
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rb") as handle:
            data = handle.read()
        if path.name.removesuffix(".gz").endswith(".jsonl"):
            _read_lines(path, data, read, strict)
        else:
            _read_array(path, data, read, strict)
        if len(read.rows) + sum(read.malformed.values()) == before:
            raise ValueError(f"data file {path} holds no rows; it is empty (or only blank lines)")
    if not read.rows:
        raise ValueError(
            f"no readable row in {[str(p) for p in paths]}: {dict(read.malformed)}; first: "
            f"{next(iter(read.first_seen.values()), '-')}"
        )
    stats = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in paths]
    fingerprint = Hasher.hash(["chat-files", READER_VERSION, stats])
    return datasets.Dataset.from_list(read.rows), fingerprint, read


def _read_lines(path: Path, data: bytes, read: ChatRows, strict: bool) -> None:
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
        try:
            row = json.loads(text)
        except json.JSONDecodeError as error:
            read.reject("invalid JSON", where, f"invalid JSON ({error.msg} at column {error.colno})", strict)
            continue
        _keep(row, where, read, strict)


def _read_array(path: Path, data: bytes, read: ChatRows, strict: bool) -> None:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise ValueError(
            f"{path}:{line}: byte {data[error.start]:#04x} is not UTF-8; re-encode the file"
        ) from error
    if not text.strip():
        return
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{path}:{error.lineno}: invalid JSON ({error.msg} at column {error.colno}); a .json file is one "
            "array of rows (write one row per line as .jsonl to have bad rows skipped instead)"
        ) from error
    if not isinstance(rows, list):
        raise ValueError(f"{path} holds a JSON {type(rows).__name__}; a .json data file is an array of rows")
    for index, row in enumerate(rows):
        _keep(row, f"{path}[{index}]", read, strict)


def _keep(row: Any, where: str, read: ChatRows, strict: bool) -> None:
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
    read.rows.append(row)
    read.where.append(where)
