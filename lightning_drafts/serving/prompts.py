"""Prompts to evaluate on: the tokens before a document's first supervised token, from a batch, a JSONL
file or a data module's held-out documents."""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_drafts.core.batch import validate_batch
from lightning_drafts.core.checks import check_int


def prompt_of_document(
    input_ids: Tensor, loss_mask: Tensor, max_prompt_tokens: int | None = None
) -> Tensor | None:
    """The tokens before a document's first supervised (assistant) token, or ``None`` if there are none.

    ``max_prompt_tokens`` keeps the last tokens of a long prompt (the ones next to the answer).
    """
    supervised = torch.as_tensor(loss_mask).reshape(-1).bool().nonzero()
    if supervised.numel() == 0 or int(supervised[0]) == 0:
        return None
    prompt = torch.as_tensor(input_ids).reshape(-1)[: int(supervised[0])].long()
    return prompt if max_prompt_tokens is None else prompt[-max_prompt_tokens:]


def prompts_from_batch(
    batch: Mapping[str, Tensor], limit: int, max_prompt_tokens: int | None = None
) -> list[Tensor]:
    """Up to ``limit`` prompts from a (packed or padded) contract batch, one per document with an answer."""
    packed = validate_batch(batch)
    prompts: list[Tensor] = []
    for row in range(packed.shape[0]):
        real = packed.attention_mask[row]
        for doc in packed.doc_ids[row][real].unique().tolist():
            in_doc = (packed.doc_ids[row] == doc) & real
            prompt = prompt_of_document(
                packed.input_ids[row][in_doc], packed.loss_mask[row][in_doc], max_prompt_tokens
            )
            if prompt is not None:
                prompts.append(prompt.cpu())
            if len(prompts) >= limit:
                return prompts
    return prompts


def load_prompts_jsonl(path: str | Path, limit: int | None = None) -> list[Tensor]:
    """Token-id prompts, one JSON line each: a list of ids or an object with ``prompt_ids`` / ``input_ids``.

    An object with ``input_ids`` and ``loss_mask`` gives the tokens before its first supervised token.
    """
    if limit is not None:
        check_int("limit", limit, 1, hint="prompts to read, or None for all")
    prompts: list[Tensor] = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        row = json.loads(line)
        if isinstance(row, dict) and "loss_mask" in row and "input_ids" in row:
            prompt = prompt_of_document(torch.tensor(row["input_ids"]), torch.tensor(row["loss_mask"]))
        elif isinstance(row, dict):
            prompt = row.get("prompt_ids", row.get("input_ids"))
        else:
            prompt = row
        if prompt is None or not isinstance(prompt, (list, Tensor)) or len(prompt) == 0:
            raise ValueError(
                f"{path}:{number} is not a prompt: write a JSON list of token ids, or an object with 'prompt_ids' "
                "(or 'input_ids' with a 'loss_mask' that marks the answer)"
            )
        prompts.append(torch.as_tensor(prompt, dtype=torch.long))
        if limit is not None and len(prompts) >= limit:
            break
    return prompts


def prompts_from_datamodule(
    datamodule: Any, limit: int, max_prompt_tokens: int | None = None
) -> list[Tensor]:
    """Held-out prompts of a ``lightning_drafts.datamodules.PackedChatDataModule`` (its validation documents).

    Falls back to the training documents, with a warning, when the data module holds out nothing.
    """
    check_int("limit", limit, 1, hint="prompts to take")
    datamodule.setup("validate")
    documents = datamodule.val_documents
    if documents is None or len(documents) == 0:
        warnings.warn(
            "the data module holds out no validation documents (set val_fraction or val_data_files); "
            "evaluating on training prompts",
            stacklevel=2,
        )
        documents = datamodule.train_documents
    prompts: list[Tensor] = []
    for index in range(len(documents)):
        ids, mask = documents.tokens(index)
        prompt = prompt_of_document(torch.tensor(ids), torch.tensor(mask), max_prompt_tokens)
        if prompt is not None:
            prompts.append(prompt)
        if len(prompts) >= limit:
            break
    return prompts
