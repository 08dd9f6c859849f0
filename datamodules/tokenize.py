"""Chat rows to token documents with an assistant-only loss mask, once, through a cached ``datasets.map``.

Each row is rendered by the chat template (:mod:`chat_render`: the characters the target speaks, one
document or one per assistant turn), then the character spans are mapped to tokens by their offsets, so
one tokeniser call per batch serves every template. A token is supervised when any of its characters
lies in a supervised span (the rule transformers uses for ``return_assistant_tokens_mask``); a token
is a reasoning token when any of its characters lies in a turn's reasoning. Documents are stored
untruncated, so changing ``max_tokens`` or the long-document policy reuses the cache.

Beside the tokens, each document carries what its row held, for the setup summary: tool calls, tool
results, reasoning tokens (all of them and those supervised), reasoning turns the template dropped and
non-text parts dropped (the row's counts ride on its first document).
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow.compute as pc
from datasets.fingerprint import Hasher
from transformers import PreTrainedTokenizerBase
from transformers.utils.chat_template_utils import render_jinja_template

from lightning_drafts.datamodules.chat_format import Conversation, MalformedRow, read_conversation
from lightning_drafts.datamodules.chat_render import render_conversation, template_roles
from lightning_drafts.datamodules.documents import Documents

# Bump when the output of tokenize_batch changes, so stale cache files are never reused.
TOKENIZE_VERSION = 3

# Per-document counts of what the rows held (summed in the setup summary).
SHAPE_COUNTS = (
    "tool_calls",
    "tool_results",
    "reasoning_tokens",
    "reasoning_supervised",
    "reasoning_dropped",
    "media_dropped",
)

# The counts of a row's messages (the others are counted on the tokens).
ROW_COUNTS = ("tool_calls", "tool_results", "reasoning_dropped", "media_dropped")

FEATURES = datasets.Features(
    {
        "input_ids": datasets.Sequence(datasets.Value("int32")),
        "loss_mask": datasets.Sequence(datasets.Value("int8")),
        "malformed": datasets.Value("string"),
        "malformed_field": datasets.Value("string"),
        # The source row a document (or a malformed row's empty document) comes from.
        "row": datasets.Value("int64"),
        **{name: datasets.Value("int32") for name in SHAPE_COUNTS},
    }
)


@dataclass(frozen=True)
class ChatOptions:
    """How rows become documents beyond the template: ``template_kwargs`` reach the template (its
    switches, e.g. ``{"enable_thinking": False}``), ``supervise_reasoning`` supervises reasoning tokens,
    ``drop_media`` drops non-text content parts (counted) instead of refusing their row."""

    template_kwargs: dict[str, Any] = field(default_factory=dict)
    supervise_reasoning: bool = True
    drop_media: bool = False


def render_with_assistant_spans(
    messages: list[dict[str, Any]], template: str, tokenizer: PreTrainedTokenizerBase
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the ``[start, end)`` character spans the target speaks, for a
    conversation that renders as one document.

    Raises :class:`MalformedRow` when the template rejects the conversation or renders no assistant text.
    """
    documents = render_conversation(Conversation(messages), template, tokenizer).documents
    if len(documents) != 1:
        raise ValueError(f"the template renders this conversation as {len(documents)} documents, not one")
    return documents[0].text, documents[0].spans


def render_prompt(
    messages: list[dict[str, Any]],
    template: str,
    tokenizer: PreTrainedTokenizerBase,
    tools: list[dict[str, Any]] | None = None,
    **template_kwargs: Any,
) -> str:
    """The text a model continues to write the next assistant turn after ``messages``: the conversation
    rendered as training renders it (with its ``tools`` definitions), plus the generation prompt
    (``template_kwargs`` reach the template, e.g. ``enable_thinking``)."""
    special = tokenizer.special_tokens_map
    return render_jinja_template(
        [template_roles(messages, template)],
        tools=tools,
        chat_template=template,
        add_generation_prompt=True,
        **{**special, **template_kwargs},
    )[0][0]


def covered_tokens(offsets: np.ndarray, spans: list[tuple[int, int]], text_length: int) -> np.ndarray:
    """1 for each token (``offsets`` is ``[N, 2]`` character ranges) overlapping one of ``spans``."""
    inside = np.zeros(text_length + 1, dtype=np.int64)
    for start, end in spans:
        inside[start] += 1
        inside[end] -= 1
    covered = np.concatenate([[0], np.cumsum(np.cumsum(inside)[:text_length] > 0)])
    if offsets.size == 0:
        return np.zeros(0, dtype=np.int8)
    return (covered[offsets[:, 1]] > covered[offsets[:, 0]]).astype(np.int8)


# The assistant mask is the tokens covering the supervised spans.
supervised_tokens = covered_tokens


def tokenize_batch(
    batch: dict[str, list],
    tokenizer: PreTrainedTokenizerBase,
    template: str,
    options: ChatOptions | None = None,
    indices: list[int] | None = None,
) -> dict[str, list]:
    """Every row of ``batch`` as its documents, or one empty document with a ``malformed`` reason;
    ``indices`` are the rows' places in their source (default: their places in ``batch``)."""
    options = options or ChatOptions()
    size = len(next(iter(batch.values())))
    indices = list(range(size)) if indices is None else indices
    rows = [{key: values[i] for key, values in batch.items()} for i in range(size)]
    out: dict[str, list] = {name: [] for name in FEATURES}
    texts, spans, reasoning = [], [], []
    for row, index in zip(rows, indices, strict=True):
        try:
            conversation = read_conversation(row, drop_media=options.drop_media)
            rendering = render_conversation(
                conversation, template, tokenizer, options.template_kwargs, options.supervise_reasoning
            )
        except MalformedRow as malformed:
            texts.append("")
            spans.append([])
            reasoning.append([])
            out["malformed"].append(malformed.reason)
            out["malformed_field"].append(malformed.field)
            out["row"].append(index)
            for name in ROW_COUNTS:
                out[name].append(0)
            continue
        counts = {
            "tool_calls": rendering.tool_calls,
            "tool_results": rendering.tool_results,
            "reasoning_dropped": rendering.reasoning_dropped,
            "media_dropped": conversation.dropped_parts,
        }
        for number, document in enumerate(rendering.documents):
            texts.append(document.text)
            spans.append(document.spans)
            reasoning.append(document.reasoning)
            out["malformed"].append("")
            out["malformed_field"].append("")
            out["row"].append(index)
            for name, count in counts.items():
                out[name].append(count if number == 0 else 0)
    backend = tokenizer.backend_tokenizer
    # The tokenizers backend directly: about a third faster than the transformers call with offsets.
    # A tokenizer.json may carry truncation or padding settings, which would cut documents silently;
    # transformers' own call clears them the same way.
    if backend.truncation is not None:
        backend.no_truncation()
    if backend.padding is not None:
        backend.no_padding()
    for encoding, text, doc_spans, doc_reasoning in zip(
        backend.encode_batch(texts, add_special_tokens=False), texts, spans, reasoning, strict=True
    ):
        count = len(encoding.ids)
        offsets = np.fromiter(chain.from_iterable(encoding.offsets), dtype=np.int64, count=2 * count)
        offsets = offsets.reshape(count, 2)
        mask = covered_tokens(offsets, doc_spans, len(text))
        thinking = covered_tokens(offsets, doc_reasoning, len(text))
        out["input_ids"].append(np.array(encoding.ids, dtype=np.int32))
        out["loss_mask"].append(mask)
        out["reasoning_tokens"].append(int(thinking.sum()))
        out["reasoning_supervised"].append(int((thinking & mask).sum()))
    return out


def _tokenize_indexed(batch: dict[str, list], indices: list[int], **kwargs: Any) -> dict[str, list]:
    """``datasets.map`` with indices passes them second."""
    return tokenize_batch(batch, indices=indices, **kwargs)


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A content hash of the tokenizer (vocabulary, normaliser, special tokens), stable across processes."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    content = backend.to_str() if backend is not None else tokenizer.name_or_path
    return Hasher.hash([content, sorted(tokenizer.special_tokens_map.items()), len(tokenizer)])


def default_cache_dir() -> Path:
    return Path(datasets.config.HF_DATASETS_CACHE) / "lightning_drafts"


def tokenize_rows(
    rows: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    template: str,
    *,
    source_fingerprint: str,
    options: ChatOptions | None = None,
    num_proc: int | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> datasets.Dataset:
    """Tokenise chat rows with ``datasets.map``; a second call with the same inputs loads the cache file.

    The cache key is the source fingerprint, the tokenizer's content hash, the template and
    :data:`TOKENIZE_VERSION`, never the pickled map function (whose hash changes when a tokenizer has
    been called), so a second run starts from the cache.
    """
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            f"tokenizer {tokenizer.name_or_path!r} is not a fast (tokenizers-backed) tokenizer; the assistant mask "
            "needs character offsets, so load it with AutoTokenizer.from_pretrained(..., use_fast=True)"
        )
    options = options or ChatOptions()
    fingerprint = Hasher.hash(
        [
            source_fingerprint,
            tokenizer_fingerprint(tokenizer),
            template,
            sorted(options.template_kwargs.items()),
            options.supervise_reasoning,
            options.drop_media,
            TOKENIZE_VERSION,
        ]
    )
    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    return rows.map(
        _tokenize_indexed,
        batched=True,
        with_indices=True,
        batch_size=256,
        fn_kwargs={"tokenizer": tokenizer, "template": template, "options": options},
        remove_columns=rows.column_names,
        features=FEATURES,
        num_proc=num_proc if num_proc and num_proc > 1 and len(rows) > 1 else None,
        cache_file_name=str(directory / f"chat-tokens-{fingerprint}.arrow"),
        new_fingerprint=fingerprint,
        desc="tokenising chats",
    )


# Malformed rows named per reason in messages (the count covers the rest).
NAMED_PER_REASON = 3


@dataclass(frozen=True)
class MalformedExample:
    """One malformed row: its index in the source, why, and the field at fault."""

    index: int
    reason: str
    field: str


@dataclass(frozen=True)
class TokenizedCorpus:
    """The valid documents of a tokenised source, the count of malformed rows by reason, the first
    :data:`NAMED_PER_REASON` of each reason (in row order), and each document's :data:`SHAPE_COUNTS`
    (arrays aligned with ``documents``)."""

    documents: Documents
    malformed: Counter
    examples: tuple[MalformedExample, ...] = ()
    shapes: dict[str, np.ndarray] = field(default_factory=dict)

    @classmethod
    def from_dataset(cls, tokenized: datasets.Dataset) -> TokenizedCorpus:
        table = tokenized.with_format("arrow")[:]
        ids = table.column("input_ids")
        lengths = pc.list_value_length(ids).to_numpy().astype(np.int64)
        flat_ids = pc.list_flatten(ids).to_numpy()
        flat_mask = pc.list_flatten(table.column("loss_mask")).to_numpy()
        reasons = table.column("malformed").to_pylist()
        starts = np.cumsum(lengths) - lengths
        valid = np.flatnonzero(np.array([reason == "" for reason in reasons], dtype=bool) & (lengths > 0))
        documents = Documents(flat_ids, flat_mask, starts[valid], lengths[valid])
        malformed = Counter(reason for reason in reasons if reason)
        examples, named = [], Counter()
        fields = table.column("malformed_field").to_pylist() if malformed else []
        rows = table.column("row").to_pylist() if malformed else []
        for index, reason in enumerate(reasons if malformed else []):
            if reason and named[reason] < NAMED_PER_REASON:
                named[reason] += 1
                examples.append(MalformedExample(rows[index], reason, fields[index]))
        shapes = {name: table.column(name).to_numpy().astype(np.int64)[valid] for name in SHAPE_COUNTS}
        return cls(documents, malformed, tuple(examples), shapes)
