"""What a data module's ``setup`` tells the user: per split, the counts of documents, tokens and what was
cut or skipped, warnings for what looks wrong (malformed rows with their places, truncation, a loss mask
that covers everything or nothing), and one training sample with its supervised tokens marked."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from transformers import PreTrainedTokenizerBase

from lightning_drafts.datamodules.documents import Documents
from lightning_drafts.datamodules.preview import CLOSE, OPEN, mark_supervised
from lightning_drafts.datamodules.tokenize import NAMED_PER_REASON


def show_console(target: logging.Logger) -> None:
    """Let ``target``'s INFO records reach the console when the application configured no logging (the
    CLI, a notebook), as Lightning does for its own logger; an application's own handlers win."""
    if target.level == logging.NOTSET:
        target.setLevel(logging.INFO)
    if not logging.getLogger().hasHandlers() and not target.handlers:
        target.addHandler(logging.StreamHandler())


def log_setup_summary(
    logger: logging.Logger,
    stats: Mapping[str, Mapping[str, Any]],
    first_malformed: Mapping[str, list[str]],
    tokenizer: PreTrainedTokenizerBase,
    train_documents: Documents,
    settings: Mapping[str, Any],
    verbose: bool,
) -> None:
    """Log ``stats`` (per split) at INFO when ``verbose`` (DEBUG otherwise); the warnings print either way.
    ``settings``: the data module's ``max_tokens``, ``long_documents`` and ``packing``."""
    show_console(logger)
    info = logger.info if verbose else logger.debug
    max_tokens = settings["max_tokens"]
    for split, counts in stats.items():
        info(
            "%s split: %d documents, %d tokens, %d supervised tokens, %d truncated, %d dropped, %d malformed; "
            "%d tool calls (supervised), %d tool results (not supervised), %d reasoning tokens (%d supervised, "
            "%d not), %d turns whose reasoning the template dropped, %d media parts dropped "
            "(max_tokens=%d, long_documents=%s, packing=%s)",
            split,
            counts["documents"],
            counts["tokens"],
            counts["supervised_tokens"],
            counts["truncated"],
            counts["dropped"],
            counts["malformed"],
            counts["tool_calls"],
            counts["tool_results"],
            counts["reasoning_tokens"],
            counts["reasoning_supervised"],
            counts["reasoning_tokens"] - counts["reasoning_supervised"],
            counts["reasoning_dropped"],
            counts["media_dropped"],
            max_tokens,
            settings["long_documents"],
            settings["packing"],
        )
        if counts["malformed"]:
            named = [
                where
                for reason in counts["malformed_reasons"]
                for where in first_malformed.get(reason, [])[:NAMED_PER_REASON]
            ]
            logger.warning(
                "%s split: %d malformed rows skipped: %s%s",
                split,
                counts["malformed"],
                counts["malformed_reasons"],
                "".join(f"\n  {where}" for where in named),
            )
        if counts["truncated"] or counts["dropped"]:
            logger.warning(
                "%s split: %d documents longer than max_tokens=%d were %s",
                split,
                counts["truncated"] or counts["dropped"],
                max_tokens,
                "truncated" if counts["truncated"] else "dropped",
            )
        if counts["answers_truncated_away"]:
            logger.warning(
                "%s split: %d of %d documents keep no supervised token: their prompt alone fills "
                "max_tokens=%d, so truncation cut the whole answer; raise max_tokens (or long_documents='drop')",
                split,
                counts["answers_truncated_away"],
                counts["documents"],
                max_tokens,
            )
        elif counts["tokens"] and counts["supervised_tokens"] in (0, counts["tokens"]):
            logger.warning(
                "%s split: %s of %d tokens are supervised; the loss mask should cover assistant tokens only, "
                "so check the chat template",
                split,
                "none" if counts["supervised_tokens"] == 0 else "all",
                counts["tokens"],
            )
    ids, mask = train_documents.tokens(0)
    info(
        "one training sample (supervised tokens between %s and %s):\n%s",
        OPEN,
        CLOSE,
        mark_supervised(tokenizer, ids[:max_tokens], mask[:max_tokens]),
    )
