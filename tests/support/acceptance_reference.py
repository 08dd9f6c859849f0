"""The acceptance length by its definition (docs/concepts/eagle3.md#simulated-acceptance-length, NeMo's
tau_sim), written out over plain lists: the independent reference a logged ``accept_len`` is compared with."""

from __future__ import annotations

from collections.abc import Iterable

from lightning_drafts.core.draft_output import DraftOutput


def accept_len_by_definition(outputs: Iterable[DraftOutput]) -> float:
    """``1 + sum over k of (chains correct and valid at 0..k) / (chains valid at 0..k)``, over k with a chain
    valid through k, the chains of every output pooled (a ratio of sums, as logged over batches)."""
    correct, valid = [], []
    for output in outputs:
        correct += output.correct.tolist()
        valid += output.valid.tolist()
    length = 1.0
    for k in range(len(valid[0]) if valid else 0):
        through = [all(v[: k + 1]) for v in valid]
        if any(through):
            hits = sum(t and all(c[: k + 1]) for t, c in zip(through, correct, strict=True))
            length += hits / sum(through)
    return length
