"""The comparison of two ``DraftOutput`` of one batch that the skip-versus-reference tests share."""

from __future__ import annotations

import torch

from lightning_drafts.core.acceptance import prefix_counts
from lightning_drafts.core.draft_output import DraftOutput

TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def assert_same_output(a: DraftOutput, b: DraftOutput) -> None:
    """Everything the module logs from a ``DraftOutput``: loss, valid tokens, metrics, ratio sums, and the
    chains the acceptance callback counts."""
    torch.testing.assert_close(a.loss, b.loss, **TOLERANCE)
    assert int(a.valid_tokens) == int(b.valid_tokens)
    assert torch.equal(a.valid, b.valid) and torch.equal(a.correct, b.correct)
    for count_a, count_b in zip(
        prefix_counts(a.correct, a.valid), prefix_counts(b.correct, b.valid), strict=True
    ):
        assert torch.equal(count_a, count_b)
    assert a.metrics.keys() == b.metrics.keys() and a.sums.keys() == b.sums.keys()
    for name in a.metrics:
        torch.testing.assert_close(a.metrics[name], b.metrics[name], **TOLERANCE, msg=name)
    for name in a.sums:
        torch.testing.assert_close(a.sums[name], b.sums[name], **TOLERANCE, msg=name)
