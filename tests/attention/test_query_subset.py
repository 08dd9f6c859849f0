"""Masks for a subset of query slots against the micro-batch flattened into one row: each form stands for
the block-causal mask's rows at those slots, and tiled attention over it gives the dense values and
gradients."""

from __future__ import annotations

import pytest
import torch

from lightning_drafts.attention.backends import block_causal_mask, dense_mask_from_mask_mod
from lightning_drafts.attention.query_subset import (
    flat_document_starts,
    subset_causal_mask,
    subset_causal_mask_mod,
    tile_subset_causal_mask,
)
from lightning_drafts.core.batch import validate_batch
from tests.attention.test_tiled_attention import dense_and_tiled
from tests.support.builders import packed_row, random_docs, stack_rows


def packed_batch():
    docs = random_docs([5, 9, 6, 12, 3, 5], seed=3)
    return validate_batch(stack_rows([packed_row(docs[:3], 22), packed_row(docs[3:], 22)]))


def subsets(count: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(4)
    return {
        "every slot": torch.arange(count),
        "sparse": torch.randperm(count, generator=gen)[: count // 3].sort().values,
        "one": torch.tensor([count - 3]),
        "across rows": torch.tensor([3, 20, 21, 22, 30, 43]),
    }


@pytest.mark.parametrize("subset", ["every slot", "sparse", "one", "across rows"])
def test_every_form_is_the_block_causal_rows_of_the_subset(subset):
    packed = packed_batch()
    batch, width = packed.shape
    slots = subsets(batch * width)[subset]
    # The reference: the block-causal mask of each row, laid out over the flattened batch.
    flat = torch.zeros(batch * width, batch * width, dtype=torch.bool)
    for row, rows_mask in enumerate(block_causal_mask(packed.doc_ids)[:, 0]):
        flat[row * width : (row + 1) * width, row * width : (row + 1) * width] = rows_mask
    expected = flat[slots][None, None]
    starts = flat_document_starts(packed.doc_start)
    assert torch.equal(subset_causal_mask(starts, slots), expected)
    for tile_queries in (2, 5, 128):
        assert torch.equal(tile_subset_causal_mask(starts, slots, tile_queries).dense(), expected)
    mask_mod = subset_causal_mask_mod(starts, slots)
    assert torch.equal(dense_mask_from_mask_mod(mask_mod, 1, slots.numel(), batch * width, "cpu"), expected)


def test_tiles_span_only_their_queries_documents():
    packed = packed_batch()
    starts = flat_document_starts(packed.doc_start)
    # Row 0's documents start at 0, 5, 14, row 1's at 22, 34, 37: queries 6..8 see columns 5..8 only,
    # queries 30, 31 columns 22..31.
    tiled = tile_subset_causal_mask(starts, torch.tensor([6, 7, 8, 30, 31]), 3)
    assert [tile.width for tile in tiled.tiles] == [4, 10]


@pytest.mark.parametrize("value_dim", [8, 5])
def test_tiled_subset_attention_matches_dense_values_and_gradients(value_dim):
    packed = packed_batch()
    batch, width = packed.shape
    slots = subsets(batch * width)["sparse"]
    starts = flat_document_starts(packed.doc_start)
    dense = subset_causal_mask(starts, slots)
    (dense_out, dense_lse, dense_grads), (out, lse, grads) = dense_and_tiled(
        dense, tile_subset_causal_mask(starts, slots, 4), value_dim
    )
    torch.testing.assert_close(out, dense_out)
    torch.testing.assert_close(lse, dense_lse)
    for got, expected in zip(grads, dense_grads, strict=True):
        torch.testing.assert_close(got, expected)
