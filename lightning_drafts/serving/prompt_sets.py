"""Text prompt sets that speculative-decoding results are compared on: MT-Bench's 80 two-turn questions,
HumanEval's 164 problems, GSM8K's 1319 test questions and MATH-500's 500 problems (shipped with the package:
``lightning_drafts/shipped/prompt_data/README.md`` gives their sources and licenses), or a user's own chat
JSONL.

A set is a list of :class:`Conversation`: the user turns of one request, in order. Turn ``k > 1`` is asked
after the target's own answer to turn ``k - 1`` (:mod:`lightning_drafts.serving.conversation_prompts`), as
MT-Bench is run.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from lightning_drafts.core.checks import check_int


@dataclass(frozen=True)
class Conversation:
    """One request of a prompt set: its user turns, asked one after another."""

    prompt_set: str
    category: str
    question_id: str
    turns: tuple[str, ...]


def _shipped_rows(file: str) -> list[dict[str, Any]]:
    data = resources.files("lightning_drafts.shipped").joinpath("prompt_data", file)
    raw = data.read_bytes()
    text = gzip.decompress(raw).decode() if file.endswith(".gz") else raw.decode()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _mt_bench() -> list[Conversation]:
    return [
        Conversation("mt-bench", row["category"], str(row["question_id"]), tuple(row["turns"]))
        for row in _shipped_rows("mt_bench.jsonl")
    ]


def _humaneval() -> list[Conversation]:
    # The problem is the function's signature and docstring: the user asks for its completion.
    return [
        Conversation("humaneval", "coding", row["task_id"], (row["prompt"],))
        for row in _shipped_rows("humaneval.jsonl.gz")
    ]


def _gsm8k() -> list[Conversation]:
    # The question alone: the reference solution and answer are not the user's turn.
    return [
        Conversation("gsm8k", "math", str(row["idx"]), (row["question"],))
        for row in _shipped_rows("gsm8k.jsonl")
    ]


def _math_500() -> list[Conversation]:
    # Per subject (algebra, geometry, ...): a few prompts then still cover every subject.
    return [
        Conversation("math-500", row["subject"], row["unique_id"], (row["problem"],))
        for row in _shipped_rows("math500.jsonl")
    ]


PROMPT_SETS: dict[str, Callable[[], list[Conversation]]] = {
    "mt-bench": _mt_bench,
    "humaneval": _humaneval,
    "gsm8k": _gsm8k,
    "math-500": _math_500,
}


def is_text_prompt_file(path: str | Path) -> bool:
    """Whether ``path``'s first row is a chat (``turns`` or ``messages``) rather than token ids."""
    for line in Path(path).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            return isinstance(row, dict) and ("turns" in row or "messages" in row)
    return False


def load_prompt_set(name_or_path: str | Path, limit: int | None = None) -> list[Conversation]:
    """The conversations of a shipped set (``mt-bench``, ``humaneval``, ``gsm8k``, ``math-500``) or of a chat
    JSONL file.

    A file row is ``{"turns": [user text, ...]}`` (MT-Bench's own format; ``category`` and ``question_id``
    are kept when present) or ``{"messages": [{"role", "content"}, ...]}``, whose user messages are the
    turns (its assistant messages are not used: every answer is the target's own).

    ``limit`` takes that many conversations, spread over the categories (the first of each category,
    then the second of each, ...), so a few prompts still cover every category.
    """
    if limit is not None:
        check_int("limit", limit, 1, hint="conversations to take, or None for all")
    name = str(name_or_path)
    conversations = PROMPT_SETS[name]() if name in PROMPT_SETS else _chat_file(Path(name))
    return spread_over_categories(conversations, limit)


def spread_over_categories(conversations: Sequence[Conversation], limit: int | None) -> list[Conversation]:
    """The first ``limit`` conversations taken round-robin over the categories, in file order within each."""
    by_category: dict[str, list[Conversation]] = {}
    for conversation in conversations:
        by_category.setdefault(conversation.category, []).append(conversation)
    chosen: list[Conversation] = []
    depth = max((len(c) for c in by_category.values()), default=0)
    for index in range(depth):
        for members in by_category.values():
            if index < len(members):
                chosen.append(members[index])
    return chosen if limit is None else chosen[:limit]


def _chat_file(path: Path) -> list[Conversation]:
    if not path.is_file():
        raise FileNotFoundError(
            f"--prompts {path}: no such file, and not a shipped prompt set ({sorted(PROMPT_SETS)})"
        )
    conversations = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        row = json.loads(line)
        turns = _user_turns(row) if isinstance(row, dict) else None
        if not turns or not all(isinstance(t, str) and t for t in turns):
            raise ValueError(
                f'{path}:{number} is not a chat prompt: write {{"turns": ["first user turn", ...]}} or '
                '{"messages": [{"role": "user", "content": "..."}, ...]} with at least one non-empty user turn'
            )
        conversations.append(
            Conversation(
                path.stem, str(row.get("category", "all")), str(row.get("question_id", number)), tuple(turns)
            )
        )
    if not conversations:
        raise ValueError(f"{path} holds no prompts")
    return conversations


def _user_turns(row: dict[str, Any]) -> list[Any] | None:
    if "turns" in row:
        return list(row["turns"]) if isinstance(row["turns"], list) else None
    messages = row.get("messages")
    if not isinstance(messages, list):
        return None
    return [m.get("content") for m in messages if isinstance(m, dict) and m.get("role") == "user"]
