"""Gathered rows added a block at a time: the formula, its gradients, and no ``[n, V]`` copy."""

from __future__ import annotations

import pytest
import torch

from lightning_drafts.core.row_blocks import ROWS, add_gathered_rows, row_blocks
from tests.support.largest_gather import LargestGather


def test_row_blocks_cover_every_row_once_in_order():
    bounds = [(s.start, s.stop) for s in row_blocks(torch.empty(37, 3))]
    assert bounds == [(0, 16), (16, 32), (32, 37)]
    assert list(row_blocks(torch.empty(0, 3))) == []
    # Off the CPU (here the meta device, as CUDA would be) a block is ACCELERATOR_ROWS rows.
    bounds = [(s.start, s.stop) for s in row_blocks(torch.empty(2100, 3, device="meta"))]
    assert bounds == [(0, 1024), (1024, 2048), (2048, 2100)]


@pytest.mark.parametrize("leading", [(2 * ROWS + 5,), (3, ROWS - 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_added_rows_equal_the_formula_and_its_gradients(dtype, leading):
    """``values + rows[index]`` written out (rows cast to the values' dtype), over more positions than a
    block, flat or not, with the rows' gradient summed per row in their own dtype."""
    gen = torch.Generator().manual_seed(0)
    vocab = 30
    values = torch.randn(*leading, vocab, generator=gen).to(dtype).requires_grad_(True)
    rows = torch.randn(4, vocab, generator=gen, requires_grad=True)
    index = torch.randint(0, 4, leading, generator=gen)
    probe = torch.randn(*leading, vocab, generator=gen)
    gather = LargestGather()
    with gather:
        added = add_gathered_rows(values * 1, rows, index)
        grads = torch.autograd.grad((added.float() * probe).sum(), (values, rows))
    expected = values * 1 + rows[index].to(dtype)
    wanted = torch.autograd.grad((expected.float() * probe).sum(), (values, rows))
    assert added.dtype == dtype and grads[1].dtype == torch.float32
    torch.testing.assert_close(added, expected, rtol=0, atol=0)
    for got, want in zip(grads, wanted, strict=True):
        torch.testing.assert_close(got, want)
    # A block at a time, never the [n, V] copy; nor a copy of the values, whatever their shape.
    assert gather.largest == ROWS * vocab and gather.clones == 0
