"""How well the training answers match the target: the share of supervised tokens that equal the target's
own greedy next token, teacher-forced.

A draft learns to predict the target, so answers the target would not have written (a dataset made by
another model, a base model's data for a fine-tuned target) teach it tokens the target then rejects at
serving time. On answers the target wrote itself at temperature 0 the share is 1 (up to re-tokenisation
of the decoded text). One target forward per sampled document, so it is cheap enough to run at the start
of every fit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lightning_drafts.core.batch import validate_batch
from lightning_drafts.training.target import FrozenTarget


@dataclass(frozen=True)
class DataMatch:
    """``matched`` of ``supervised`` tokens (over ``documents`` documents) equal the target's greedy token."""

    matched: int
    supervised: int
    documents: int

    @property
    def share(self) -> float | None:
        return self.matched / self.supervised if self.supervised else None

    def describe(self) -> str:
        """The figure as the fit console and ``regenerate --check`` print it."""
        if self.share is None:
            return f"no supervised token in {self.documents} training documents to compare with the target"
        return (
            f"{self.share:.1%} of {self.supervised:,} supervised tokens in {self.documents} training "
            "documents are the target's own greedy next token"
        )


@torch.no_grad()
def target_match(target: FrozenTarget, documents, num_documents: int = 16, seed: int = 0) -> DataMatch:
    """:class:`DataMatch` over ``num_documents`` documents drawn (seeded) from ``documents`` (a
    :class:`~lightning_drafts.datamodules.documents.Documents`): at every supervised token past the
    first position, is it the target's greedy prediction from the tokens before it?"""
    if num_documents < 1:
        raise ValueError(f"num_documents = {num_documents}; it must be >= 1")
    supervised = np.flatnonzero(documents.supervised_per_document() > 0)
    chosen = np.sort(np.random.default_rng(seed).permutation(supervised)[:num_documents])
    device = target.lm_head.weight.device
    matched = total = 0
    for index in chosen:
        input_ids, loss_mask = documents.tokens(int(index))
        tokens = torch.tensor(np.asarray(input_ids, dtype=np.int64), device=device)
        packed = validate_batch({"input_ids": tokens[None]}, vocab_size=target.vocab_size)
        greedy = target.greedy_tokens(target(packed).last_hidden_state)[0]
        # Prediction at t is of token t + 1; a supervised token at position 0 has no context to predict it.
        mask = torch.tensor(np.asarray(loss_mask[1:]) > 0, device=device)
        matched += int((greedy[:-1] == tokens[1:])[mask].sum())
        total += int(mask.sum())
    return DataMatch(matched, total, len(chosen))
