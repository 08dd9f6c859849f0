"""Chat rows in, one normalised conversation out: OpenAI ``messages`` or ShareGPT ``conversations``.

A row that cannot become a trainable conversation raises :class:`MalformedRow` with a short reason;
the tokenisation step catches it, keeps the row as an empty document and counts the reason, so a bad
row never crashes a run and never disappears silently.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

ROLES = ("system", "user", "assistant")

# ShareGPT exports disagree on speaker names; these are the spellings seen in the common dumps.
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
}


class MalformedRow(Exception):
    """A row that cannot be trained on; ``reason`` is the short label it is counted under, ``field`` the
    part of the row at fault (e.g. ``messages[2].role``; empty when it is the whole row)."""

    def __init__(self, reason: str, field: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.field = field


def normalize_conversation(row: Mapping[str, Any]) -> list[dict[str, str]]:
    """The row's conversation as ``[{"role", "content"}, ...]`` with roles in :data:`ROLES`.

    Raises :class:`MalformedRow` for an unknown role, a non-string content, an empty conversation or one
    without an assistant turn (nothing to supervise).
    """
    if row.get("messages") is not None:
        key, read = "messages", _openai_message
    elif row.get("conversations") is not None:
        key, read = "conversations", _sharegpt_message
    else:
        raise MalformedRow("no 'messages' or 'conversations' field")
    turns = _as_list(row[key], key)
    messages = [read(turn, f"{key}[{index}]") for index, turn in enumerate(turns)]
    if not messages:
        raise MalformedRow("empty conversation", key)
    if not any(message["role"] == "assistant" for message in messages):
        raise MalformedRow("no assistant turn", f"{key}[*].{'role' if key == 'messages' else 'from'}")
    return messages


def _as_list(value: Any, field: str) -> list:
    if not isinstance(value, (list, tuple)):
        raise MalformedRow("conversation is not a list", field)
    return list(value)


def _openai_message(turn: Any, field: str) -> dict[str, str]:
    if not isinstance(turn, Mapping):
        raise MalformedRow("message is not an object", field)
    role = turn.get("role")
    if role not in ROLES:
        raise MalformedRow(f"unknown role {role!r}", f"{field}.role")
    return {"role": role, "content": _content(turn.get("content"), f"{field}.content")}


def _sharegpt_message(turn: Any, field: str) -> dict[str, str]:
    if not isinstance(turn, Mapping):
        raise MalformedRow("message is not an object", field)
    speaker = turn.get("from")
    role = SHAREGPT_ROLES.get(speaker.lower() if isinstance(speaker, str) else speaker)
    if role is None:
        raise MalformedRow(f"unknown role {speaker!r}", f"{field}.from")
    return {"role": role, "content": _content(turn.get("value"), f"{field}.value")}


def _content(content: Any, field: str) -> str:
    if not isinstance(content, str):
        raise MalformedRow("message content is not a string", field)
    return content
