"""Acceptance statistics: hand values, and rank-split sums equal the single-process figure."""

from __future__ import annotations

import pytest
import torch

from lightning_drafts.core.acceptance import AcceptanceStats, acceptance_length, prefix_counts
from lightning_drafts.core.draft_output import DraftOutput


def chains(rows: list[str]) -> torch.Tensor:
    return torch.tensor([[c == "1" for c in row] for row in rows])


@pytest.mark.parametrize(
    ("hits", "valid", "expected"),
    [([2, 1], [4, 4], 1.75), ([2, 2], [4, 4], 2.0), ([2, 0], [4, 4], 1.5), ([0, 0], [0, 0], 1.0)],
)
def test_acceptance_length_hand_values(hits, valid, expected):
    assert float(acceptance_length(torch.tensor(hits), torch.tensor(valid))) == pytest.approx(expected)


def test_prefix_counts_stop_at_the_first_miss_and_drop_chains_cut_by_the_document_end():
    correct = chains(["111", "101", "011", "110"])
    valid = chains(["111", "111", "111", "100"])  # the last chain ends with its document after one step
    hits, chain_valid = prefix_counts(correct, valid)
    assert hits.tolist() == [3, 1, 1]
    assert chain_valid.tolist() == [4, 3, 3]
    assert float(acceptance_length(hits, chain_valid)) == pytest.approx(1 + 3 / 4 + 1 / 3 + 1 / 3)


def test_stats_split_over_updates_equal_one_update():
    gen = torch.Generator().manual_seed(0)
    correct = torch.rand(50, 4, generator=gen) > 0.3
    valid = torch.rand(50, 4, generator=gen) > 0.1
    whole, split = AcceptanceStats(4), AcceptanceStats(4)
    whole.update(correct, valid)
    for part in range(0, 50, 7):
        split.update(correct[part : part + 7], valid[part : part + 7])
    a, b = whole.compute(), split.compute()
    assert (
        a.keys() == b.keys() == {"accept_len", "acc_pos0", "acc_pos1", "acc_pos2", "acc_pos3", "valid_tokens"}
    )
    for key in a:
        assert torch.equal(a[key], b[key])
    assert float(a["acc_pos0"]) == pytest.approx(float((correct & valid)[:, 0].sum() / valid[:, 0].sum()))


def test_draft_output_rejects_mismatched_chains():
    with pytest.raises(ValueError, match="\\[M, K\\]"):
        DraftOutput(
            loss=torch.zeros(()),
            correct=torch.zeros(3, 2, dtype=torch.bool),
            valid=torch.zeros(3, 4, dtype=torch.bool),
        )
