"""Show a tokenised document as text with its supervised tokens marked, for the setup log.

A wrong chat template or an all-ones / all-zeros loss mask is the most common silent failure in draft
training; one marked sample in the log makes it visible before any compute is spent.
"""

from __future__ import annotations

import numpy as np
from transformers import PreTrainedTokenizerBase

OPEN, CLOSE = "⟦", "⟧"


def mark_supervised(
    tokenizer: PreTrainedTokenizerBase, input_ids: np.ndarray, loss_mask: np.ndarray, max_chars: int = 3000
) -> str:
    """Decode ``input_ids`` with every run of supervised tokens wrapped in ``⟦...⟧``.

    Runs are cut out of decodes of growing prefixes rather than decoded alone, so tokenizers that drop
    a leading space when decoding (SentencePiece) keep the text's real spacing.
    """
    ids = np.asarray(input_ids).tolist()
    mask = np.asarray(loss_mask).astype(bool)
    if not ids:
        return ""
    boundaries = [0, *(np.flatnonzero(mask[1:] != mask[:-1]) + 1).tolist(), len(ids)]
    pieces, previous = [], ""
    for begin, end in zip(boundaries[:-1], boundaries[1:], strict=True):
        text = tokenizer.decode(ids[:end], skip_special_tokens=False)
        piece, previous = text[len(previous) :], text
        pieces.append(f"{OPEN}{piece}{CLOSE}" if mask[begin] else piece)
    shown = "".join(pieces)
    if len(shown) > max_chars:
        shown = shown[:max_chars] + f" ... [{len(shown) - max_chars} more characters]"
    return shown
