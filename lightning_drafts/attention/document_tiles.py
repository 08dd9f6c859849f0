"""The block-causal mask of a packed batch built straight as query tiles, never as ``[B, 1, T, T]``.

:func:`~lightning_drafts.attention.backends.block_causal_mask` is ``T x T`` booleans per row (1 GiB at
32k tokens, and 4 GiB more where SDPA turns it into a float mask), whatever the documents: memory
quadratic in the row width. A query at row position ``t`` sees the columns ``[doc_start[t], t]``, so a
tile of consecutive queries ``[s, e)`` sees nothing outside ``[min doc_start[s], e)`` (positions only
grow along a row, and so do document starts): the predicate is evaluated on that grid only, which for
chat-length documents is about one document wide. The memory of the mask is then linear in the row
width (times the longest document), and it is the same mask: each tile keeps, per row, the visible
columns :func:`~lightning_drafts.attention.tiled.tile_dense_mask` keeps, in the same order (only the
fillers after them, masked for every query, may be other columns).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from lightning_drafts.attention.tiled import TILE_QUERIES, TiledMask, assemble, visible_columns


def tile_block_causal_mask(doc_start: Tensor, tile_queries: int = TILE_QUERIES) -> TiledMask:
    """:func:`~lightning_drafts.attention.backends.block_causal_mask` of the rows whose document starts
    are ``doc_start`` (long ``[B, T]``, :attr:`~lightning_drafts.core.batch.PackedBatch.doc_start`) as a
    :class:`~lightning_drafts.attention.tiled.TiledMask` of ``tile_queries`` queries per tile."""
    if doc_start.dim() != 2:
        raise ValueError(f"doc_start must be [B, T], got shape {tuple(doc_start.shape)}")
    batch, width = doc_start.shape
    device = doc_start.device
    starts = list(range(0, width, tile_queries))
    # One host sync for every tile's first candidate column (the earliest document start of its queries).
    lows = doc_start[:, starts].amin(0).tolist() if starts else []

    def pieces() -> Iterable[tuple[int, Tensor, Tensor]]:
        for start, low in zip(starts, lows, strict=True):
            stop = min(start + tile_queries, width)
            columns = torch.arange(low, stop, device=device)
            queries = torch.arange(start, stop, device=device)
            visible = (columns >= doc_start[:, start:stop, None]) & (columns <= queries[:, None])
            yield start, *visible_columns(visible, columns.expand(batch, -1))

    return assemble(pieces(), batch, width, width)
