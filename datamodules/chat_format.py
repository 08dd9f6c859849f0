"""Chat rows in, one normalised conversation out: OpenAI ``messages`` or ShareGPT ``conversations``.

A message's content is a string or, in the OpenAI form, a list of parts (``[{"type": "text", "text":
...}]``), whose text parts are joined with newlines (as vLLM joins them); a part of any other type
(an image, audio) cannot be trained on by a text draft and makes the row malformed.

A row that cannot become a trainable conversation raises :class:`MalformedRow` with a short reason;
the tokenisation step catches it, keeps the row as an empty document and counts the reason, so a bad
row never crashes a run and never disappears silently. A row a reader already judged carries its
verdict under :data:`MALFORMED_KEY` / :data:`MALFORMED_FIELD_KEY` and raises it here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

ROLES = ("system", "user", "assistant")

# The verdict of a reader that normalised a row early (the row-by-row file reader), carried to the
# tokenisation step so the row keeps its place and its location: the reason and the field at fault.
MALFORMED_KEY = "__malformed__"
MALFORMED_FIELD_KEY = "__malformed_field__"

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


def normalize_conversation(row: Mapping[str, Any], require_answers: bool = True) -> list[dict[str, str]]:
    """The row's conversation as ``[{"role", "content"}, ...]`` with roles in :data:`ROLES`.

    Raises :class:`MalformedRow` for an unknown role, roles out of order (see :func:`_check_order`), a content that is neither a string nor a list of
    text parts, an empty conversation or one without an assistant turn (nothing to supervise), and, with
    ``require_answers``, an empty assistant answer: its only supervised token would be the end-of-turn
    marker, teaching the draft to stop at once (``regenerate``, which writes the answers, passes False).
    """
    if row.get(MALFORMED_KEY):
        raise MalformedRow(row[MALFORMED_KEY], row.get(MALFORMED_FIELD_KEY) or "")
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
    _check_order(messages, key)
    if not any(message["role"] == "assistant" for message in messages):
        raise MalformedRow("no assistant turn", f"{key}[*].{'role' if key == 'messages' else 'from'}")
    if require_answers:
        for index, message in enumerate(messages):
            if message["role"] == "assistant" and not message["content"].strip():
                text = "content" if key == "messages" else "value"
                raise MalformedRow("empty assistant answer", f"{key}[{index}].{text}")
    return messages


def _check_order(messages: list[dict[str, str]], key: str) -> None:
    """Refuse roles out of the order every chat template accepts: an optional system message first, then
    user and assistant turns in turn, the user's first. A lenient template renders two user turns in a
    row or an assistant turn first without a word, a strict one (Mistral's) refuses them at serving, and
    a draft trained on them learns a conversation no engine sends."""
    role_field = "role" if key == "messages" else "from"
    previous = "system"
    for index, message in enumerate(messages):
        role = message["role"]
        if role == "system" and index == 0:
            continue
        expected = "user" if previous in ("system", "assistant") else "assistant"
        if role != expected:
            found = f"{role} first" if index == 0 or previous == "system" else f"{role} after {previous}"
            raise MalformedRow(f"roles out of order: {found}", f"{key}[{index}].{role_field}")
        previous = role


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
    if isinstance(content, str):
        return content
    if not isinstance(content, (list, tuple)):
        raise MalformedRow("message content is not a string", field)
    texts = []
    for index, part in enumerate(content):
        if not isinstance(part, Mapping):
            raise MalformedRow("content part is not an object", f"{field}[{index}]")
        kind = part.get("type")
        if kind != "text":
            raise MalformedRow(
                f"content part of type {kind!r}: only text parts can be trained on", f"{field}[{index}].type"
            )
        if not isinstance(part.get("text"), str):
            raise MalformedRow("text part without a string 'text'", f"{field}[{index}].text")
        texts.append(part["text"])
    return "\n".join(texts)
