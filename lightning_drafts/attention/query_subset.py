"""Document-causal masks for a chosen subset of query slots of a micro-batch laid out as one row.

When only some slots still need an output (EAGLE-3's training-time-test steps after the first, where a
slot with nothing left to supervise is dropped), the queries are those slots gathered from every row
into one sequence of ``N``, and the keys are the micro-batch flattened to ``B * T`` columns (flat slot
``b * T + t``). Documents are contiguous in that order, so the block-causal rule "same document and not
later" becomes an interval per query: query slot ``s`` sees columns ``[start[s], s]``, with ``start`` the
flat index of its document's first token. Queries are given in ascending flat order (row-major), so a
tile of consecutive queries covers one contiguous span of columns, and the tiled mask only has to drop
the columns no query of the tile sees.

The three forms match :mod:`~lightning_drafts.attention.backends`: a dense boolean mask (``eager``, the
reference), a :class:`~lightning_drafts.attention.tiled.TiledMask` (``sdpa`` on CPU), a flex
``mask_mod`` for a ``BlockMask`` (GPU).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_drafts.attention.backends import MaskMod
from lightning_drafts.attention.tiled import MaskTile, TiledMask

# Queries per tile. A subset is sparser than a whole row, so a tile of 256 of them spans about twice the
# key columns a dense tile does; 128 keeps the computed area near the visible one (1.6x on the benchmark
# corpus at EAGLE-3's live slots, against 2.2x at 256 and 1.3x at 64, where per-tile costs take over).
SUBSET_TILE_QUERIES = 128


def flat_document_starts(doc_start: Tensor) -> Tensor:
    """Long ``[B * T]``: the flat index ``b * T + doc_start[b, t]`` of each slot's document start."""
    batch, width = doc_start.shape
    rows = torch.arange(batch, device=doc_start.device)[:, None] * width
    return (rows + doc_start).reshape(-1)


def subset_causal_mask(starts: Tensor, slots: Tensor) -> Tensor:
    """Boolean ``[1, 1, N, B * T]``: query ``n`` (flat slot ``slots[n]``) sees ``[starts[slots[n]], slots[n]]``."""
    columns = torch.arange(starts.numel(), device=slots.device)
    mask = (columns >= starts[slots][:, None]) & (columns <= slots[:, None])
    return mask[None, None]


def tile_subset_causal_mask(
    starts: Tensor, slots: Tensor, tile_queries: int = SUBSET_TILE_QUERIES
) -> TiledMask:
    """:func:`subset_causal_mask` as query tiles, built without the dense ``N x B * T`` mask.

    ``slots`` must be ascending: each tile then keeps the contiguous columns from its first query's
    document start to its last query. The only columns in that span no query of the tile sees are a
    document's dead tail and documents without a live slot, so none are dropped, and every tile of the
    call is built by the same dozen tensor ops (per-tile ops cost a thread synchronisation each, which
    on a busy machine outweighed the attention they fed).
    """
    count, kv_len, device = slots.numel(), starts.numel(), slots.device
    firsts = torch.arange(0, count, tile_queries, device=device)
    lasts = (firsts + tile_queries).clamp(max=count) - 1
    low = starts[slots[firsts]]
    widths = slots[lasts] - low + 1
    rows = lasts - firsts + 1
    # One host sync for every tile's shape.
    shapes = torch.stack([rows, widths], dim=-1).tolist()
    widest = max((width for _, width in shapes), default=1)
    columns = low[:, None] + torch.arange(widest, device=device)
    in_tile = torch.arange(widest, device=device) < widths[:, None]
    # Queries and columns of every tile padded to tile_queries x widest, then the real ones kept, tile
    # after tile and row-major inside a tile: each tile's bias is then one contiguous piece.
    query_index = (firsts[:, None] + torch.arange(tile_queries, device=device)).clamp(max=max(count - 1, 0))
    queries = slots[query_index]
    visible = (columns[:, None, :] >= starts[queries][:, :, None]) & (
        columns[:, None, :] <= queries[:, :, None]
    )
    kept = (torch.arange(tile_queries, device=device) < rows[:, None])[:, :, None] & in_tile[:, None, :]
    bias = torch.zeros(visible.shape, dtype=torch.float32, device=device).masked_fill_(
        ~visible, float("-inf")
    )
    pieces = bias[kept].split([height * width for height, width in shapes])
    tiles = tuple(
        MaskTile(start, start + height, width, piece.view(1, 1, height, width), None)
        for start, (height, width), piece in zip(range(0, count, tile_queries), shapes, pieces, strict=True)
    )
    return TiledMask(tiles, columns[in_tile], 1, count, kv_len)


def subset_causal_mask_mod(starts: Tensor, slots: Tensor) -> MaskMod:
    """The flex ``mask_mod`` of :func:`subset_causal_mask` (batch 1, ``N`` queries, ``B * T`` keys)."""
    query_starts = starts[slots]
    # A tensor of its own, not a view of the live-slot split: dynamo guards a captured view's storage offset,
    # which moves from step to step (one compiled variant each).
    slots = slots.clone()

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (kv_idx >= query_starts[q_idx]) & (kv_idx <= slots[q_idx])

    return mask_mod
