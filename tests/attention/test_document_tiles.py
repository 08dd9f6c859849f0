"""The block-causal mask built straight as query tiles: it is the dense mask, and it never costs ``T x T``."""

from __future__ import annotations

import pytest
import torch

from lightning_drafts.attention.backends import block_causal_mask
from lightning_drafts.attention.document_tiles import tile_block_causal_mask
from lightning_drafts.attention.tiled import tile_dense_mask
from lightning_drafts.core.batch import validate_batch
from tests.support.builders import packed_row, padded_rows, random_docs, stack_rows


def rows() -> list:
    docs = random_docs([5, 9, 6, 12, 3, 5, 1, 17], seed=3)
    packed = validate_batch(stack_rows([packed_row(docs[:3], 24), packed_row(docs[3:7], 24)]))
    padded = validate_batch(padded_rows(docs[5:], 20))
    return [packed, padded]


def written_out(doc_start: torch.Tensor) -> torch.Tensor:
    """Query t sees key j iff j lies in t's document and not after t: ``doc_start[t] <= j <= t``."""
    batch, width = doc_start.shape
    mask = torch.zeros(batch, 1, width, width, dtype=torch.bool)
    for b in range(batch):
        for t in range(width):
            mask[b, 0, t, int(doc_start[b, t]) : t + 1] = True
    return mask


@pytest.mark.parametrize("tile_queries", [1, 4, 7, 256])
def test_the_tiles_are_the_block_causal_mask(tile_queries):
    for packed in rows():
        tiled = tile_block_causal_mask(packed.doc_start, tile_queries)
        assert torch.equal(tiled.dense(), written_out(packed.doc_start))
        assert torch.equal(tiled.dense(), block_causal_mask(packed.doc_ids))
        # The same keys per tile as tiling the dense mask, so attention over them is the same sum.
        reference = tile_dense_mask(block_causal_mask(packed.doc_ids), tile_queries)
        assert [t.width for t in tiled.tiles] == [t.width for t in reference.tiles]


def test_a_tile_is_about_one_document_wide_however_long_the_row():
    lengths = [40] * 50
    packed = validate_batch(packed_row(random_docs(lengths, seed=1), sum(lengths)))
    tiled = tile_block_causal_mask(packed.doc_start, 16)
    # A tile of 16 queries sees at most its own 16 and the 39 earlier keys of its first query's document.
    assert max(tile.width for tile in tiled.tiles) <= 16 + 39
    assert max(tile.bias.numel() for tile in tiled.tiles) <= 16 * (16 + 39)


def test_a_mask_of_no_rows_is_refused_with_its_shape():
    with pytest.raises(ValueError, match=r"doc_start must be \[B, T\], got shape \(4,\)"):
        tile_block_causal_mask(torch.zeros(4, dtype=torch.long))
