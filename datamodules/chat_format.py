"""Chat rows in, one normalised conversation out: OpenAI ``messages`` or ShareGPT ``conversations``.

Every message shape of the OpenAI chat format is kept as a chat template reads it:

* ``system`` / ``developer`` and ``user`` messages: their text;
* ``assistant`` messages: their text, their ``tool_calls`` (each ``{"type": "function", "id"?, "function":
  {"name", "arguments"}}``, the arguments parsed from their JSON string into an object, as vLLM hands
  them to a template) and their reasoning (``reasoning_content``, or its other names ``reasoning`` and
  ``thinking``); a ``<think>`` block inside the content is left there for the template to split;
* ``tool`` messages: the result's text, with ``tool_call_id`` and ``name`` when given;
* the row's ``tools`` (function definitions), passed to the template as ``tools=``.

A message's content is a string or a list of parts (``[{"type": "text", "text": ...}]``), whose text
parts are joined with newlines (as vLLM joins them). A part of another type (an image, audio) cannot
be trained on by a text draft: it makes the row malformed, or, with ``drop_media``, it is dropped and
counted. Keys a message does not carry stay absent (a template tests ``'tool_calls' in message``).

A row that cannot become a trainable conversation raises :class:`MalformedRow` with a short reason;
the tokenisation step catches it, keeps the row as an empty document and counts the reason, so a bad
row never crashes a run and never disappears silently. A row a reader already judged carries its
verdict under :data:`MALFORMED_KEY` / :data:`MALFORMED_FIELD_KEY` and raises it here; a row it kept
carries the normalised conversation as JSON under :data:`CONVERSATION_KEY` (Arrow would otherwise give
every message every key of every other message, and every tool call's arguments every argument name).

:func:`conversation_row` writes a conversation back as a row of the format it was read in.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

ROLES = ("system", "developer", "user", "assistant", "tool")

# The verdict of a reader that normalised a row early (the row-by-row file reader), carried to the
# tokenisation step so the row keeps its place and its location: the reason and the field at fault.
MALFORMED_KEY = "__malformed__"
MALFORMED_FIELD_KEY = "__malformed_field__"
# A row the reader normalised: ``{"messages", "tools", "dropped_parts"}`` as a JSON string.
CONVERSATION_KEY = "__conversation__"

# ShareGPT exports disagree on speaker names; these are the spellings seen in the common dumps
# (``function_call`` / ``observation`` are the tool-calling speakers of LLaMA-Factory's ShareGPT form).
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "function_call": "assistant",
    "observation": "tool",
    "tool": "tool",
}

# The names a message's reasoning goes by (transformers reads the same three).
REASONING_FIELDS = ("reasoning_content", "reasoning", "thinking")


@dataclass(frozen=True)
class Conversation:
    """A normalised row: its messages, its tool definitions (None without), how many non-text content
    parts were dropped from it (``drop_media``), and the field its turns came in (``messages``, OpenAI's,
    or ``conversations``, ShareGPT's: a rewritten row goes back in its input's format)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    dropped_parts: int = 0
    key: str = "messages"

    def to_json(self) -> str:
        return json.dumps(
            {
                "messages": self.messages,
                "tools": self.tools,
                "dropped_parts": self.dropped_parts,
                "key": self.key,
            }
        )


class MalformedRow(Exception):
    """A row that cannot be trained on; ``reason`` is the short label it is counted under, ``field`` the
    part of the row at fault (e.g. ``messages[2].role``; empty when it is the whole row)."""

    def __init__(self, reason: str, field: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.field = field


def normalize_conversation(row: Mapping[str, Any], require_answers: bool = True) -> list[dict[str, Any]]:
    """The row's messages (see :func:`read_conversation`, whose rules apply, non-text parts refused)."""
    return read_conversation(row, require_answers).messages


def read_conversation(
    row: Mapping[str, Any], require_answers: bool = True, drop_media: bool = False
) -> Conversation:
    """The row as a :class:`Conversation`, messages with roles in :data:`ROLES`.

    Raises :class:`MalformedRow` for an unknown role, roles out of order (see :func:`_check_order`), a
    content that is neither a string nor a list of parts, a non-text part (unless ``drop_media``), a
    malformed tool call or tool definition, an empty conversation or one without an assistant turn
    (nothing to supervise), and, with ``require_answers``, an assistant turn with neither text nor a
    tool call: its only supervised token would be the end-of-turn marker, teaching the draft to stop at
    once (``regenerate``, which writes the answers, passes False).
    """
    if row.get(MALFORMED_KEY):
        raise MalformedRow(row[MALFORMED_KEY], row.get(MALFORMED_FIELD_KEY) or "")
    if row.get(CONVERSATION_KEY):
        stored = json.loads(row[CONVERSATION_KEY])
        conversation = Conversation(
            stored["messages"], stored["tools"], stored["dropped_parts"], stored["key"]
        )
        if require_answers:
            _check_answers(conversation.messages, "messages")
        return conversation
    if row.get("messages") is not None:
        key, read = "messages", _openai_message
    elif row.get("conversations") is not None:
        key, read = "conversations", _sharegpt_message
    else:
        raise MalformedRow("no 'messages' or 'conversations' field")
    turns = _as_list(row[key], key)
    dropped: list[int] = []
    messages = [read(turn, f"{key}[{index}]", drop_media, dropped) for index, turn in enumerate(turns)]
    if not messages:
        raise MalformedRow("empty conversation", key)
    _check_order(messages, key)
    if not any(message["role"] == "assistant" for message in messages):
        raise MalformedRow("no assistant turn", f"{key}[*].{'role' if key == 'messages' else 'from'}")
    if require_answers:
        _check_answers(messages, key)
    return Conversation(messages, _tools(row.get("tools")), sum(dropped), key)


def conversation_row(conversation: Conversation) -> dict[str, Any]:
    """``conversation`` as a row of the format it was read in (its ``key``): OpenAI ``messages`` with the
    row's ``tools``, or a ShareGPT row (:func:`sharegpt_row`); reading the row gives the conversation back."""
    if conversation.key == "conversations":
        return sharegpt_row(conversation)
    row: dict[str, Any] = {"messages": conversation.messages}
    if conversation.tools is not None:
        row["tools"] = conversation.tools
    return row


def sharegpt_row(conversation: Conversation) -> dict[str, Any]:
    """``conversation`` as a ShareGPT row in LLaMA-Factory's tool form, the inverse of reading one: speakers
    ``system`` / ``human`` / ``gpt``, a turn that only calls tools as ``function_call`` (the JSON of its call,
    or of the list of its calls), a tool result as ``observation``, reasoning, call ids and the calls of a
    turn that also speaks as the extra keys the reader takes, and ``tools`` as a JSON string."""
    speakers = {
        "system": "system",
        "developer": "system",
        "user": "human",
        "assistant": "gpt",
        "tool": "observation",
    }
    turns = []
    for message in conversation.messages:
        extras = {
            k: message[k] for k in ("reasoning_content", "tool_calls", "tool_call_id", "name") if k in message
        }
        if set(extras) == {"tool_calls"} and not message["content"]:
            calls = [call["function"] for call in message["tool_calls"]]
            value = json.dumps(calls[0] if len(calls) == 1 else calls, ensure_ascii=False)
            turns.append({"from": "function_call", "value": value})
        else:
            turns.append({"from": speakers[message["role"]], "value": message["content"]} | extras)
    row: dict[str, Any] = {"conversations": turns}
    if conversation.tools is not None:
        row["tools"] = json.dumps(conversation.tools, ensure_ascii=False)
    return row


def _check_answers(messages: list[dict[str, Any]], key: str) -> None:
    for index, message in enumerate(messages):
        if (
            message["role"] == "assistant"
            and not message["content"].strip()
            and not message.get("tool_calls")
        ):
            text = "content" if key == "messages" else "value"
            raise MalformedRow("empty assistant answer", f"{key}[{index}].{text}")


def _check_order(messages: list[dict[str, Any]], key: str) -> None:
    """Refuse roles out of the order every chat template accepts: system or developer messages first,
    then user and assistant turns in turn, the user's first; after an assistant turn that calls tools
    come their results (``tool`` messages), then the assistant again. A lenient template renders two
    user turns in a row or an assistant turn first without a word, a strict one (Mistral's) refuses
    them at serving, and a draft trained on them learns a conversation no engine sends. A result names
    its call by ``tool_call_id``: one that names no call of the turn before it is refused."""
    role_field = "role" if key == "messages" else "from"
    previous, calls = "system", None
    for index, message in enumerate(messages):
        role = message["role"]
        if role in ("system", "developer") and previous == "system":
            continue
        if previous in ("system", "user"):
            expected = ("user",) if previous == "system" else ("assistant",)
        elif previous == "assistant":
            expected = ("user", "tool") if calls else ("user",)
        else:
            expected = ("tool", "assistant")
        if role not in expected:
            if role == "tool":
                found = "tool result without a tool call before it"
            else:
                found = f"{role} first" if previous == "system" else f"{role} after {previous}"
            raise MalformedRow(f"roles out of order: {found}", f"{key}[{index}].{role_field}")
        if role == "assistant":
            calls = {call.get("id") for call in message.get("tool_calls", ())}
        elif role == "tool" and message.get("tool_call_id") and None not in calls:
            if message["tool_call_id"] not in calls:
                raise MalformedRow(
                    f"tool result for call id {message['tool_call_id']!r}, which the turn before does not make",
                    f"{key}[{index}].tool_call_id",
                )
        previous = role


def _as_list(value: Any, field: str) -> list:
    if not isinstance(value, (list, tuple)):
        raise MalformedRow("conversation is not a list", field)
    return list(value)


def _openai_message(turn: Any, field: str, drop_media: bool, dropped: list[int]) -> dict[str, Any]:
    if not isinstance(turn, Mapping):
        raise MalformedRow("message is not an object", field)
    role = turn.get("role")
    if role not in ROLES:
        raise MalformedRow(f"unknown role {role!r}", f"{field}.role")
    content = turn.get("content")
    if role == "assistant" and content is None and turn.get("tool_calls"):
        content = ""
    message = {"role": role, "content": _content(content, f"{field}.content", drop_media, dropped)}
    return _extras(message, turn, field)


def _sharegpt_message(turn: Any, field: str, drop_media: bool, dropped: list[int]) -> dict[str, Any]:
    if not isinstance(turn, Mapping):
        raise MalformedRow("message is not an object", field)
    speaker = turn.get("from")
    name = speaker.lower() if isinstance(speaker, str) else speaker
    role = SHAREGPT_ROLES.get(name)
    if role is None:
        raise MalformedRow(f"unknown role {speaker!r}", f"{field}.from")
    if name == "function_call":
        # LLaMA-Factory writes a call as the JSON of {"name", "arguments"} (or a list of them).
        calls = _json_value(turn.get("value"), f"{field}.value", "function call")
        calls = calls if isinstance(calls, list) else [calls]
        wrapped = [{"type": "function", "function": call} for call in calls]
        return {"role": role, "content": "", "tool_calls": _tool_calls(wrapped, f"{field}.value")}
    message = {"role": role, "content": _content(turn.get("value"), f"{field}.value", drop_media, dropped)}
    return _extras(message, turn, field)


def _extras(message: dict[str, Any], turn: Mapping[str, Any], field: str) -> dict[str, Any]:
    """The keys beside the content a template reads: tool calls and reasoning of an assistant turn, the
    call id and function name of a tool result."""
    role = message["role"]
    if role == "assistant":
        if turn.get("tool_calls"):
            message["tool_calls"] = _tool_calls(turn["tool_calls"], f"{field}.tool_calls")
        for name in REASONING_FIELDS:
            if turn.get(name) is not None:
                if not isinstance(turn[name], str):
                    raise MalformedRow("reasoning is not a string", f"{field}.{name}")
                message["reasoning_content"] = turn[name]
                break
    elif role == "tool":
        for name in ("tool_call_id", "name"):
            if turn.get(name) is not None:
                message[name] = str(turn[name])
    return message


def _tool_calls(calls: Any, field: str) -> list[dict[str, Any]]:
    if not isinstance(calls, (list, tuple)):
        raise MalformedRow("tool_calls is not a list", field)
    normalised = []
    for index, call in enumerate(calls):
        where = f"{field}[{index}]"
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise MalformedRow("tool call without a function name", f"{where}.function.name")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            arguments = _json_value(arguments, f"{where}.function.arguments", "tool call arguments")
        if not isinstance(arguments, Mapping):
            raise MalformedRow("tool call arguments are not an object", f"{where}.function.arguments")
        made = {"type": call.get("type") or "function"}
        if call.get("id") is not None:
            made["id"] = str(call["id"])
        made["function"] = {"name": function["name"], "arguments": dict(arguments)}
        normalised.append(made)
    return normalised


def _tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None or (isinstance(tools, str) and not tools.strip()):
        return None
    if isinstance(tools, str):
        tools = _json_value(tools, "tools", "tools")
    if not isinstance(tools, (list, tuple)) or not all(isinstance(tool, Mapping) for tool in tools):
        raise MalformedRow("tools is not a list of objects", "tools")
    return [dict(tool) for tool in tools] or None


def _json_value(text: Any, field: str, what: str) -> Any:
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise MalformedRow(f"{what} are not JSON ({error.msg})", field) from error


def _content(content: Any, field: str, drop_media: bool = False, dropped: list[int] | None = None) -> str:
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
            if drop_media and dropped is not None:
                dropped.append(1)
                continue
            raise MalformedRow(
                f"content part of type {kind!r}: only text parts can be trained on (drop_media=True drops "
                "them and counts them)",
                f"{field}[{index}].type",
            )
        if not isinstance(part.get("text"), str):
            raise MalformedRow("text part without a string 'text'", f"{field}[{index}].text")
        texts.append(part["text"])
    return "\n".join(texts)
