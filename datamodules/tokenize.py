"""Chat rows to token documents with an assistant-only loss mask, once, through a cached ``datasets.map``.

The assistant mask is computed on characters, then mapped to tokens by their offsets, so one tokeniser
call per batch serves every template:

* a template with ``{% generation %}`` tags reports the character spans of assistant output directly;
* without tags, each assistant turn ``i`` is located by prefix rendering: the span runs from the end of
  ``render(messages[:i], add_generation_prompt=True)`` to the end of ``render(messages[:i + 1])``. A
  template whose partial renders are not prefixes of the full render cannot be masked this way; its
  rows are reported as malformed with a hint to add generation tags.

A token is supervised when any of its characters lies in an assistant span (the rule transformers
uses for ``return_assistant_tokens_mask``). Documents are stored untruncated, so changing
``max_tokens`` or the long-document policy reuses the cache.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow.compute as pc
from datasets.fingerprint import Hasher
from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase
from transformers.utils.chat_template_utils import render_jinja_template

from lightning_drafts.datamodules.chat_format import MalformedRow, normalize_conversation
from lightning_drafts.datamodules.documents import Documents
from lightning_drafts.datamodules.templates import has_generation_tags

# Bump when the output of tokenize_batch changes, so stale cache files are never reused.
TOKENIZE_VERSION = 2

FEATURES = datasets.Features(
    {
        "input_ids": datasets.Sequence(datasets.Value("int32")),
        "loss_mask": datasets.Sequence(datasets.Value("int8")),
        "malformed": datasets.Value("string"),
        "malformed_field": datasets.Value("string"),
    }
)


def render_with_assistant_spans(
    messages: list[dict[str, str]], template: str, tokenizer: PreTrainedTokenizerBase
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the ``[start, end)`` character spans of assistant output.

    Raises :class:`MalformedRow` when the template rejects the conversation or renders no assistant text.
    """
    special = tokenizer.special_tokens_map
    try:
        if has_generation_tags(template):
            rendered, indices = render_jinja_template(
                [messages], chat_template=template, return_assistant_tokens_mask=True, **special
            )
            text, spans = rendered[0], [tuple(span) for span in indices[0]]
        else:
            text, spans = _render_by_prefixes(messages, template, special)
    except TemplateError as error:
        raise MalformedRow(f"chat template rejected the row: {str(error)[:80]}") from error
    spans = [(start, end) for start, end in spans if end > start]
    if not spans:
        raise MalformedRow("chat template rendered no assistant text")
    return text, spans


def render_prompt(
    messages: list[dict[str, str]], template: str, tokenizer: PreTrainedTokenizerBase, **template_kwargs: Any
) -> str:
    """The text a model continues to write the next assistant turn after ``messages``: the conversation
    rendered as training renders it, plus the generation prompt (``template_kwargs`` reach the template,
    e.g. ``enable_thinking``)."""
    special = tokenizer.special_tokens_map
    return render_jinja_template(
        [messages], chat_template=template, add_generation_prompt=True, **special, **template_kwargs
    )[0][0]


def _render_by_prefixes(
    messages: list[dict[str, str]], template: str, special: dict[str, Any]
) -> tuple[str, list[tuple[int, int]]]:
    def render(part: list[dict[str, str]], prompt: bool) -> str:
        return render_jinja_template([part], chat_template=template, add_generation_prompt=prompt, **special)[
            0
        ][0]

    full = render(messages, False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(messages[:i], True)
        through = render(messages[: i + 1], False)
        if not (full.startswith(through) and through.startswith(before)):
            raise MalformedRow(
                "chat template renders turns inconsistently; add {% generation %} tags to mask assistant tokens"
            )
        spans.append((len(before), len(through)))
    return full, spans


def supervised_tokens(offsets: np.ndarray, spans: list[tuple[int, int]], text_length: int) -> np.ndarray:
    """1 for each token (``offsets`` is ``[N, 2]`` character ranges) overlapping an assistant span."""
    inside = np.zeros(text_length + 1, dtype=np.int64)
    for start, end in spans:
        inside[start] += 1
        inside[end] -= 1
    covered = np.concatenate([[0], np.cumsum(np.cumsum(inside)[:text_length] > 0)])
    if offsets.size == 0:
        return np.zeros(0, dtype=np.int8)
    return (covered[offsets[:, 1]] > covered[offsets[:, 0]]).astype(np.int8)


def tokenize_batch(
    batch: dict[str, list], tokenizer: PreTrainedTokenizerBase, template: str
) -> dict[str, list]:
    """``datasets.map`` function: every row becomes a document, or an empty one with a ``malformed`` reason."""
    size = len(next(iter(batch.values())))
    rows = [{key: values[i] for key, values in batch.items()} for i in range(size)]
    texts, spans, reasons, fields = [], [], [], []
    for row in rows:
        try:
            text, row_spans = render_with_assistant_spans(normalize_conversation(row), template, tokenizer)
            reasons.append("")
            fields.append("")
        except MalformedRow as malformed:
            text, row_spans = "", []
            reasons.append(malformed.reason)
            fields.append(malformed.field)
        texts.append(text)
        spans.append(row_spans)
    backend = tokenizer.backend_tokenizer
    # The tokenizers backend directly: about a third faster than the transformers call with offsets.
    # A tokenizer.json may carry truncation or padding settings, which would cut documents silently;
    # transformers' own call clears them the same way.
    if backend.truncation is not None:
        backend.no_truncation()
    if backend.padding is not None:
        backend.no_padding()
    input_ids, loss_mask = [], []
    for encoding, text, row_spans in zip(
        backend.encode_batch(texts, add_special_tokens=False), texts, spans, strict=True
    ):
        count = len(encoding.ids)
        offsets = np.fromiter(chain.from_iterable(encoding.offsets), dtype=np.int64, count=2 * count)
        input_ids.append(np.array(encoding.ids, dtype=np.int32))
        loss_mask.append(supervised_tokens(offsets.reshape(count, 2), row_spans, len(text)))
    return {"input_ids": input_ids, "loss_mask": loss_mask, "malformed": reasons, "malformed_field": fields}


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
    fingerprint = Hasher.hash(
        [source_fingerprint, tokenizer_fingerprint(tokenizer), template, TOKENIZE_VERSION]
    )
    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    return rows.map(
        tokenize_batch,
        batched=True,
        batch_size=256,
        fn_kwargs={"tokenizer": tokenizer, "template": template},
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
    """One malformed row: its index in the tokenised table, why, and the field at fault."""

    index: int
    reason: str
    field: str


@dataclass(frozen=True)
class TokenizedCorpus:
    """The valid documents of a tokenised source, the count of malformed rows by reason, and the first
    :data:`NAMED_PER_REASON` of each reason (in row order)."""

    documents: Documents
    malformed: Counter
    examples: tuple[MalformedExample, ...] = ()

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
        for index, reason in enumerate(reasons if malformed else []):
            if reason and named[reason] < NAMED_PER_REASON:
                named[reason] += 1
                examples.append(MalformedExample(index, reason, fields[index]))
        return cls(documents, malformed, tuple(examples))
