"""The offline default: a real chat corpus and a real tokenizer that ship inside pip packages.

* Corpus: ``chitchat-dataset`` (MIT), 7,168 two-person conversations from the Chit Chat Challenge, in
  ``chitchat_dataset/dataset.json``. Each conversation is a list of turns; a turn is one speaker's
  consecutive utterances. Roles: the speaker who opens the conversation is the ``user``, the other one
  the ``assistant``, so every reply to an opener is supervised. Utterances of one turn are joined with a
  newline; empty utterances are dropped (and turns left empty with them, merging neighbours of the same
  speaker); a trailing user turn is dropped because nothing after it is supervised, so it would only
  cost compute. The 3,151 conversations where only the opener spoke have no reply to learn from and
  are left out by default (``include_unanswered=True`` keeps them; they then count as malformed rows
  "no assistant turn"), which leaves 4,017 conversations (3.6M tokens; median 406 tokens).
* Tokenizer: ``mistral-common`` (Apache-2.0) ships the 32,000-piece SentencePiece model of Mistral 7B v1
  (``mistral_common/data/tokenizer.model.v1``). It is converted to a fast ``tokenizers`` tokenizer that
  encodes exactly like SentencePiece (checked on every utterance of the corpus), with the built-in
  ``mistral`` chat template. It has no pad token; ``<unk>`` (id 0) serves as pad because byte fallback
  means SentencePiece never emits it, so the vocabulary stays at 32,000 ids.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import lru_cache
from importlib import resources
from pathlib import Path

import datasets
from datasets.fingerprint import Hasher
from transformers import PreTrainedTokenizerFast

from lightning_drafts.datamodules.templates import MISTRAL_TEMPLATE

EMBEDDED_VOCAB_SIZE = 32_000
EMBEDDED_PAD_TOKEN_ID = 0
# Bump when the conversion below changes, so cached tokenisations of the old rows are not reused.
CORPUS_VERSION = 1


def corpus_path() -> Path:
    """``dataset.json`` of the installed ``chitchat-dataset`` package."""
    return Path(str(resources.files("chitchat_dataset").joinpath("dataset.json")))


def tokenizer_model_path() -> Path:
    """The SentencePiece model shipped by ``mistral-common``."""
    return Path(str(resources.files("mistral_common").joinpath("data", "tokenizer.model.v1")))


def embedded_corpus_rows(include_unanswered: bool = False) -> Iterator[dict]:
    """Yield chitchat conversations as ``{"id", "messages"}`` rows, in the file's order."""
    with open(corpus_path(), encoding="utf-8") as handle:
        conversations = json.load(handle)
    for conversation_id, conversation in conversations.items():
        turns: list[tuple[str, str]] = []
        for turn in conversation["messages"]:
            text = "\n".join(u["text"].strip() for u in turn if u["text"].strip())
            if not text:
                continue
            sender = turn[0]["sender"]
            if turns and turns[-1][0] == sender:
                turns[-1] = (sender, turns[-1][1] + "\n" + text)
            else:
                turns.append((sender, text))
        if not turns:
            continue
        opener = turns[0][0]
        messages = [{"role": "user" if s == opener else "assistant", "content": t} for s, t in turns]
        if messages[-1]["role"] == "user" and len(messages) > 1:
            messages.pop()
        if len(messages) < 2 and not include_unanswered:
            continue
        yield {"id": conversation_id, "messages": messages}


@lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    # Converting the SentencePiece proto takes about a second; the serialised result reloads in a
    # fraction of that, so a process converts once however many data modules it builds.
    from transformers.convert_slow_tokenizer import SentencePieceExtractor, SpmConverter

    proto = SentencePieceExtractor(str(tokenizer_model_path())).proto
    vocab = {piece.piece: index for index, piece in enumerate(proto.pieces)}
    backend = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab, legacy=True)
    return backend.to_str()


def load_embedded_tokenizer() -> PreTrainedTokenizerFast:
    """A fresh Mistral v1 tokenizer (32,000 ids, pad = ``<unk>`` = 0) with the ``mistral`` chat template."""
    from tokenizers import Tokenizer

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json()),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<unk>",
        chat_template=MISTRAL_TEMPLATE,
    )
    tokenizer.name_or_path = "mistral-common/tokenizer.model.v1"
    return tokenizer


@lru_cache(maxsize=2)
def embedded_corpus_dataset(include_unanswered: bool = False) -> datasets.Dataset:
    """The corpus rows as a ``datasets.Dataset`` (built once per process; datasets are immutable)."""
    return datasets.Dataset.from_list(list(embedded_corpus_rows(include_unanswered)))


def embedded_corpus_fingerprint(include_unanswered: bool = False) -> str:
    """Cache key of the converted corpus: the installed file and the conversion version."""
    stat = corpus_path().stat()
    return Hasher.hash(["chitchat", CORPUS_VERSION, stat.st_size, stat.st_mtime_ns, include_unanswered])
