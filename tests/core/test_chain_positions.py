"""ChainPositions: the supervised chain positions gathered flat and scattered back, or every position."""

from __future__ import annotations

import pytest
import torch

from lightning_drafts.core.chain_positions import ChainPositions

VALID = torch.tensor([[True, False, True], [False, False, False], [False, True, False]])


def test_gather_keeps_the_supervised_positions_in_row_major_order():
    values = torch.arange(9.0).view(3, 3, 1).expand(3, 3, 2)
    positions = ChainPositions.of(VALID, supervised_only=True)
    assert positions.count == 3
    assert positions.gather(values)[:, 0].tolist() == [0.0, 2.0, 7.0]
    assert positions.gather(torch.arange(9).view(3, 3)).tolist() == [0, 2, 7]


def test_scatter_puts_values_back_and_the_fill_elsewhere():
    positions = ChainPositions.of(VALID, supervised_only=True)
    back = positions.scatter(torch.tensor([5, 6, 7]), fill=-1)
    assert back.tolist() == [[5, -1, 6], [-1, -1, -1], [-1, 7, -1]]
    flags = positions.scatter(torch.tensor([True, False, True]), fill=False)
    assert flags.dtype == torch.bool and flags.tolist() == [
        [True, False, False],
        [False] * 3,
        [False, True, False],
    ]


def test_gradients_reach_only_the_kept_positions():
    states = torch.randn(3, 3, 4, requires_grad=True)
    positions = ChainPositions.of(VALID, supervised_only=True)
    kept = positions.gather(states)
    (positions.scatter(kept.sum(-1)) * 2.0).sum().backward()
    expected = VALID[..., None].float().expand(3, 3, 4) * 2.0
    assert torch.equal(states.grad, expected)


def test_every_position_is_the_flat_view_itself():
    states = torch.randn(3, 3, 4)
    positions = ChainPositions.of(VALID, supervised_only=False)
    assert positions.index is None and positions.count == 9
    flat = positions.gather(states)
    assert flat.shape == (9, 4) and flat.data_ptr() == states.data_ptr()
    assert torch.equal(positions.scatter(flat), states)


def test_nothing_supervised_gives_empty_rows():
    positions = ChainPositions.of(torch.zeros(2, 3, dtype=torch.bool), supervised_only=True)
    assert positions.gather(torch.randn(2, 3, 5)).shape == (0, 5)
    assert torch.equal(positions.scatter(torch.empty(0), fill=1.5), torch.full((2, 3), 1.5))


def test_mismatched_shapes_are_refused_with_the_shapes():
    positions = ChainPositions.of(VALID, supervised_only=True)
    with pytest.raises(ValueError, match=r"expected a \[3, 3, \.\.\.\] tensor, got shape \(3, 2, 4\)"):
        positions.gather(torch.randn(3, 2, 4))
    with pytest.raises(ValueError, match="expected 3 values .* got 4"):
        positions.scatter(torch.randn(4))
    with pytest.raises(ValueError, match=r"valid must be \[m, D\] chains, got shape \(9,\)"):
        ChainPositions.of(VALID.flatten(), supervised_only=True)
