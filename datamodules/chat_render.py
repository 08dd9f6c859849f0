"""A conversation rendered as the target's chat template renders it, with the characters the target speaks.

The target speaks its assistant turns: their text, their tool calls and their reasoning. System, user
and developer text, tool results and the template's role headers are prompt. Each assistant turn's
span is found one of two ways:

* a template with ``{% generation %}`` tags reports the span itself (``return_assistant_tokens_mask``);
* otherwise by prefix rendering: the turn runs from where ``render(messages[:i],
  add_generation_prompt=True)`` stops agreeing with ``render(messages[:i + 1])`` (so a generation prompt
  that opens the turn, Qwen3's ``<think>\\n\\n</think>\\n\\n`` with thinking off, is prompt) to the end of
  the latter, cut after the first end-of-sequence token in it (a template that writes a newline after
  the turn's end marker has the target stop before that newline). ``render(messages[:i])`` must be a
  prefix of ``render(messages[:i + 1])``: a template that rewrites the text before a turn as the turn is
  added cannot be masked this way, and its rows are malformed with a hint to add generation tags.

**One document per assistant turn where the template rewrites history.** A template may render an
earlier turn differently once later turns follow: Qwen3's drops the reasoning of the turns before the
last user query, DeepSeek-R1's drops every turn's ``<think>`` block. Serving sends the rendering of the
conversation so far, so when some ``render(messages[:i + 1])`` is not a prefix of the whole rendering,
the row becomes one document per assistant turn ``i``: ``render(messages[:i + 1])`` with only turn
``i`` supervised, exactly the prompt the engine sends and the text the target answers with.

**Reasoning.** A turn's reasoning (``reasoning_content``, or the ``<think>`` block of its content) is
found inside the turn's span, with the ``<think>`` / ``</think>`` tags around it; it is supervised
unless ``supervise_reasoning`` is False (then the answer after it is supervised alone). A turn whose
reasoning the template did not render is counted as dropped.

**Roles.** A ``developer`` message reaches a template that names the role as written, and any other
template as ``system`` (OpenAI defines it as the system message of its reasoning models).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase
from transformers.utils.chat_template_utils import render_jinja_template

from lightning_drafts.datamodules.chat_format import Conversation, MalformedRow
from lightning_drafts.datamodules.templates import has_generation_tags

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

Span = tuple[int, int]


@dataclass(frozen=True)
class RenderedDocument:
    """One document's text, the ``[start, end)`` character spans supervised, and the character spans of
    reasoning the template rendered inside assistant turns (supervised or not)."""

    text: str
    spans: list[Span]
    reasoning: list[Span] = field(default_factory=list)


@dataclass(frozen=True)
class Rendering:
    """The documents of one row and what the template did with it."""

    documents: list[RenderedDocument]
    tool_calls: int = 0
    tool_results: int = 0
    reasoning_dropped: int = 0


def render_conversation(
    conversation: Conversation,
    template: str,
    tokenizer: PreTrainedTokenizerBase,
    template_kwargs: dict[str, Any] | None = None,
    supervise_reasoning: bool = True,
) -> Rendering:
    """The documents ``conversation`` trains as (see the module docstring).

    Raises :class:`MalformedRow` when the template rejects the conversation or renders no assistant text.
    """
    messages = template_roles(conversation.messages, template)
    renderer = _Renderer(template, tokenizer, conversation.tools, template_kwargs or {})
    turns = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
    try:
        # Each rendering through a turn, with the spans a tagged template marks; the last is the whole.
        rendered = {len(messages) - 1: renderer.render(messages)}
        for i in turns:
            if i not in rendered:
                rendered[i] = renderer.render(messages[: i + 1])
        full = rendered[len(messages) - 1][0]
        through = {i: rendered[i][0] for i in turns}
        if all(full.startswith(through[i]) for i in turns):
            groups = [(full, turns)]
        else:
            groups = [(through[i], [i]) for i in turns]
        documents, dropped = [], 0
        for text, group in groups:
            spans, reasoning = [], []
            for i in group:
                start, end = renderer.turn_span(messages, i, through[i], rendered[i][1])
                found = _reasoning_span(text, start, end, _reasoning_of(messages[i]))
                if found is None:
                    dropped += bool(_reasoning_of(messages[i]).strip())
                    spans.append((start, end))
                    continue
                reasoning.append(found)
                spans += [(start, end)] if supervise_reasoning else [(start, found[0]), (found[1], end)]
            spans = [(start, end) for start, end in spans if end > start]
            if spans:
                documents.append(RenderedDocument(text, spans, reasoning))
    except TemplateError as error:
        raise MalformedRow(f"chat template rejected the row: {str(error)[:80]}") from error
    if not documents:
        raise MalformedRow("chat template rendered no assistant text")
    return Rendering(
        documents,
        tool_calls=sum(len(messages[i].get("tool_calls", ())) for i in turns),
        tool_results=sum(message["role"] == "tool" for message in messages),
        reasoning_dropped=dropped,
    )


def template_roles(messages: list[dict[str, Any]], template: str) -> list[dict[str, Any]]:
    """``messages`` with ``developer`` read as ``system`` by a template that does not name the role."""
    if "developer" in template:
        return messages
    return [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]


class _Renderer:
    def __init__(
        self,
        template: str,
        tokenizer: PreTrainedTokenizerBase,
        tools: list[dict[str, Any]] | None,
        template_kwargs: dict[str, Any],
    ) -> None:
        self.template = template
        self.tagged = has_generation_tags(template)
        self.eos = tokenizer.eos_token or ""
        self.context = {**tokenizer.special_tokens_map, **template_kwargs}
        self.tools = tools

    def __call__(self, messages: list[dict[str, Any]], prompt: bool = False) -> str:
        return self.render(messages, prompt)[0]

    def render(self, messages: list[dict[str, Any]], prompt: bool = False) -> tuple[str, list[Span]]:
        rendered, indices = render_jinja_template(
            [messages],
            tools=self.tools,
            chat_template=self.template,
            add_generation_prompt=prompt,
            return_assistant_tokens_mask=self.tagged,
            **self.context,
        )
        return rendered[0], [tuple(span) for span in indices[0]] if self.tagged else []

    def turn_span(self, messages: list[dict[str, Any]], i: int, through: str, tagged: list[Span]) -> Span:
        """Where assistant turn ``i`` lies in ``through`` (the rendering of ``messages[: i + 1]``, whose
        generation-tagged spans are ``tagged``)."""
        if self.tagged:
            return tagged[-1] if tagged else (len(through), len(through))
        if not through.startswith(self(messages[:i])):
            raise MalformedRow(
                "chat template renders turns inconsistently (adding a turn rewrites the text before it); add "
                "{% generation %} tags to mask assistant tokens"
            )
        start = len(os.path.commonprefix([self(messages[:i], prompt=True), through]))
        end = len(through)
        if self.eos:
            stop = through.find(self.eos, start)
            if stop >= 0:
                end = stop + len(self.eos)
        return start, end


def _reasoning_of(message: dict[str, Any]) -> str:
    """The turn's reasoning: its ``reasoning_content``, or the ``<think>`` block of its content (split as
    Qwen3's template splits it)."""
    if message.get("reasoning_content") is not None:
        return message["reasoning_content"]
    content = message.get("content") or ""
    if THINK_CLOSE not in content:
        return ""
    return content.split(THINK_CLOSE)[0].split(THINK_OPEN)[-1]


def _reasoning_span(text: str, start: int, end: int, reasoning: str) -> Span | None:
    """The characters of ``reasoning`` inside ``text[start:end]``, widened over the ``<think>`` and
    ``</think>`` tags around it, or None when the template did not render it there."""
    needle = reasoning.strip()
    if not needle:
        return None
    at = text.find(needle, start, end)
    if at < 0:
        return None
    first, last = at, at + len(needle)
    head = text[start:first].rstrip()
    if head.endswith(THINK_OPEN):
        first = start + len(head) - len(THINK_OPEN)
    tail = text[last:end]
    if tail.lstrip().startswith(THINK_CLOSE):
        last += len(tail) - len(tail.lstrip()) + len(THINK_CLOSE)
    return first, last
