"""The attention layout of block drafts (DFlash, DFlash2, DSpark) and its document-aware mask.

All blocks of a micro-batch are laid out back to back in ONE flat attention problem (batch 1):

* keys / values, ``R + M * block_size`` long: ``[context: the R real tokens of all rows, row-major |
  block 0 | block 1 | ... | block M-1]``;
* queries, ``M * block_size`` long: the block slots only (the context is never a query).

Padding never enters (only real tokens are context) and no row is padded to the busiest one. A
block's query sees (docs/concepts/dflash.md#block-attention):

* context keys of its own row and document strictly before its anchor (the anchor's own features
  do not exist yet at decode time), optionally only the last ``sliding_window`` positions counted
  from the query's own sequence position ``anchor + offset``;
* all ``block_size`` keys of its own block (two-way), never another block.

Because real tokens are flattened row-major and documents are contiguous, "own row, own document,
before the anchor" is the contiguous key range ``[context_start, context_end)``: the mask needs two
gathers per query and no per-key document lookup. Every query sees at least its own block, so no
row is fully masked and nothing NaNs.

The predicate exists once, as a flex ``mask_mod``; :func:`dense_block_mask` evaluates the same
predicate on broadcast index grids (the ``eager`` reference), and :func:`tiled_block_mask` evaluates it
only over each query tile's own key ranges (the ``sdpa`` CPU path: a dense ``Q x KV`` mask of a packed
micro-batch would make every block pay for every document's context). Build the mask once per batch
and share it by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from lightning_drafts.attention.anchors import flatten_anchors
from lightning_drafts.attention.backends import MaskMod, block_mask_from_mask_mod, resolve_backend
from lightning_drafts.attention.tiled import TiledMask, assemble, visible_columns
from lightning_drafts.core.batch import PackedBatch
from lightning_drafts.core.rules import int_rule

# Queries per tile of the CPU block mask. Measured on the speed benchmark's packed DFlash2 and DSpark
# micro-batches (block 16), the draft attention's forward and backward took 10 % and 20 % less time with
# per-document tiles of at most 128 queries than with 256-query tiles that ran across documents.
BLOCK_TILE_QUERIES = 128

# A draft without a window passes None (and exports use_sliding_window false) instead.
SLIDING_WINDOW = int_rule("sliding_window", 1, hint="the context window of every draft layer")


@dataclass(frozen=True)
class BlockLayout:
    """Where every block and context key of a micro-batch sits in the flat draft attention.

    ``rows`` / ``anchors`` / ``slots``: per block (``[M]``), its row, anchor row position and column
    in the ``[B, N]`` anchors tensor. ``context_index``: the flat ``b * T + t`` index of each context
    key (``[R]``). ``context_start`` / ``context_end``: per block, the first context key of the
    anchor's document and the anchor's own context key (an exclusive bound).
    """

    block_size: int
    width: int
    rows: Tensor
    anchors: Tensor
    slots: Tensor
    context_index: Tensor
    context_start: Tensor
    context_end: Tensor

    @property
    def num_blocks(self) -> int:
        return int(self.rows.numel())

    @property
    def num_context(self) -> int:
        return int(self.context_index.numel())

    @property
    def q_len(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def kv_len(self) -> int:
        return self.num_context + self.q_len

    def select(self, kept: Tensor) -> BlockLayout:
        """The layout of the blocks ``kept`` (bool ``[M]``) alone, in their order, over the same context.

        A block's queries see only the context and their own block, so each kept block computes what
        it did beside the others.
        """
        if kept.shape != self.rows.shape or kept.dtype != torch.bool:
            raise ValueError(
                f"kept must be a bool [{self.num_blocks}] mask of blocks, got {kept.dtype} {tuple(kept.shape)}"
            )
        return replace(
            self,
            rows=self.rows[kept],
            anchors=self.anchors[kept],
            slots=self.slots[kept],
            context_start=self.context_start[kept],
            context_end=self.context_end[kept],
        )

    def gather_context(self, per_token: Tensor) -> Tensor:
        """``[B, T, ...]`` per-token values (e.g. captured target features) -> ``[R, ...]`` context keys."""
        return per_token.reshape(-1, *per_token.shape[2:])[self.context_index]

    def block_offsets(self) -> Tensor:
        return torch.arange(self.block_size, device=self.anchors.device)

    def block_row_positions(self) -> Tensor:
        """``[M, block_size]`` row positions ``anchor + k`` (may run past a document end for partial blocks)."""
        return self.anchors[:, None] + self.block_offsets()

    def block_position_ids(self, position_ids: Tensor) -> Tensor:
        """``[M, block_size]`` RoPE positions: the anchor's document-local position plus the slot offset."""
        return position_ids[self.rows, self.anchors][:, None] + self.block_offsets()

    def block_input_ids(self, input_ids: Tensor, mask_token_id: int, known: Tensor | None = None) -> Tensor:
        """``[M, block_size]`` draft inputs: the real tokens of the first ``known[m]`` slots (default 1,
        the anchor), ``mask_token_id`` after them. Known slots must lie inside the row."""
        known = torch.ones_like(self.anchors) if known is None else known
        positions = self.block_row_positions().clamp(max=self.width - 1)
        real = input_ids[self.rows[:, None], positions]
        return torch.where(self.block_offsets() < known[:, None], real, torch.full_like(real, mask_token_id))


def block_layout(packed: PackedBatch, anchors: Tensor, block_size: int) -> BlockLayout:
    """The flat layout of the blocks of ``[B, N]`` anchors (``-1`` = none) over ``packed``'s real tokens."""
    blocks = flatten_anchors(anchors)
    real = packed.attention_mask.reshape(-1)
    # Context key of each real token: its rank among the real tokens of the micro-batch.
    key_of_token = real.long().cumsum(0) - 1
    width = packed.shape[1]
    anchor_flat = blocks.rows * width + blocks.positions
    start_flat = blocks.rows * width + packed.doc_start[blocks.rows, blocks.positions]
    return BlockLayout(
        block_size=block_size,
        width=width,
        rows=blocks.rows,
        anchors=blocks.positions,
        slots=blocks.slots,
        context_index=real.nonzero().squeeze(1),
        context_start=key_of_token[start_flat],
        context_end=key_of_token[anchor_flat],
    )


def block_mask_mod(layout: BlockLayout, sliding_window: int | None = None) -> MaskMod:
    """The flex ``mask_mod`` of the block-draft mask (batch index ignored: the layout is one flat row).

    Flex pads queries to its tile size, so the block index is clamped and padded queries masked.
    """
    _check_window(sliding_window)
    size, blocks, context = layout.block_size, max(layout.num_blocks, 1), layout.num_context
    start, end, q_len = layout.context_start, layout.context_end, layout.q_len

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        block = (q_idx // size).clamp(max=blocks - 1)
        visible_context = (kv_idx >= start[block]) & (kv_idx < end[block])
        if sliding_window is not None:
            # (anchor + offset) - position < window, in flat keys (positions of one document are contiguous).
            visible_context = visible_context & (kv_idx > end[block] + q_idx % size - sliding_window)
        own_block = (kv_idx >= context) & ((kv_idx - context) // size == block)
        return (q_idx < q_len) & (visible_context | own_block)

    return mask_mod


def dense_block_mask(layout: BlockLayout, sliding_window: int | None = None) -> Tensor:
    """Boolean ``[1, 1, Q, KV]`` form of :func:`block_mask_mod` (SDPA / CPU)."""
    device = layout.anchors.device
    q_idx = torch.arange(layout.q_len, device=device)[:, None]
    kv_idx = torch.arange(layout.kv_len, device=device)[None, :]
    zero = torch.zeros((), dtype=torch.long, device=device)
    return block_mask_mod(layout, sliding_window)(zero, zero, q_idx, kv_idx)[None, None]


def tiled_block_mask(layout: BlockLayout, sliding_window: int | None = None) -> TiledMask:
    """:func:`block_mask_mod` as a :class:`~lightning_drafts.attention.tiled.TiledMask`.

    A tile holds consecutive blocks of one document (blocks are ordered row-major and anchors ascend
    inside a row, so a document's blocks are consecutive): its context candidates are that document's
    context up to its last anchor, and its block keys are its own slots; the predicate is evaluated only
    on that grid. A tile spanning two documents would compute every query against both contexts, half of
    it for nothing, so a document's blocks are cut into tiles of their own, of equal size and at most
    :data:`BLOCK_TILE_QUERIES` queries; only documents too small to fill a quarter of a tile share one,
    since a tile of a few queries runs the kernel far below its rate.
    """
    size, context = layout.block_size, layout.num_context
    device = layout.anchors.device
    zero = torch.zeros((), dtype=torch.long, device=device)
    mask_mod = block_mask_mod(layout, sliding_window)
    spans = _block_tiles(layout, max(1, BLOCK_TILE_QUERIES // size))
    bounds = _tile_context_bounds(layout, spans)

    def pieces():
        for (first, last), (low, high) in zip(spans, bounds, strict=True):
            columns = torch.cat(
                [
                    torch.arange(low, high, device=device),
                    torch.arange(context + first * size, context + last * size, device=device),
                ]
            )
            queries = torch.arange(first * size, last * size, device=device)
            visible = mask_mod(zero, zero, queries[:, None], columns[None, :])
            yield first * size, *visible_columns(visible[None], columns[None])

    return assemble(pieces(), 1, layout.q_len, layout.kv_len)


def _block_tiles(layout: BlockLayout, per_tile: int) -> list[tuple[int, int]]:
    """``(first, stop)`` block ranges of the tiles (one host sync): each document's blocks cut into
    ``ceil(n / per_tile)`` near-equal tiles, and consecutive documents of fewer than ``per_tile / 4``
    blocks gathered into one tile while it has room."""
    blocks = layout.num_blocks
    if blocks == 0:
        return []
    starts = layout.context_start
    # Documents are told apart by their first context key, which no two documents share.
    first_of_document = torch.ones(blocks, dtype=torch.bool, device=starts.device)
    first_of_document[1:] = starts[1:] != starts[:-1]
    edges = [*first_of_document.nonzero().squeeze(1).tolist(), blocks]
    tiles: list[tuple[int, int]] = []
    sharing = False  # the last tile holds small documents only
    for first, stop in zip(edges[:-1], edges[1:], strict=False):
        count = stop - first
        if 4 * count < per_tile:
            if sharing and stop - tiles[-1][0] <= per_tile:
                tiles[-1] = (tiles[-1][0], stop)
            else:
                tiles.append((first, stop))
                sharing = True
            continue
        step = -(-count // -(-count // per_tile))
        tiles += [(start, min(start + step, stop)) for start in range(first, stop, step)]
        sharing = False
    return tiles


def _tile_context_bounds(layout: BlockLayout, spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Per tile, the hull ``[min context_start, max context_end)`` of its blocks (one host sync)."""
    if not spans:
        return []
    device = layout.context_start.device
    counts = torch.tensor([stop - first for first, stop in spans], device=device)
    tile_of_block = torch.repeat_interleave(torch.arange(len(spans), device=device), counts)
    low = torch.full((len(spans),), layout.num_context, dtype=torch.long, device=device)
    low = low.scatter_reduce(0, tile_of_block, layout.context_start, "amin")
    high = torch.zeros(len(spans), dtype=torch.long, device=device)
    high = torch.maximum(high.scatter_reduce(0, tile_of_block, layout.context_end, "amax"), low)
    return [tuple(pair) for pair in torch.stack([low, high], 1).tolist()]


def build_block_mask(
    layout: BlockLayout, backend: str, sliding_window: int | None = None
) -> Tensor | TiledMask | object:
    """The mask for ``backend``: a :class:`~lightning_drafts.attention.tiled.TiledMask` for ``"sdpa"``,
    the dense bool tensor for ``"eager"`` (the reference math), a flex ``BlockMask`` for ``"flex"``.
    Build it once per batch; every draft layer reuses it."""
    if backend == "sdpa":
        return tiled_block_mask(layout, sliding_window)
    if backend == "eager":
        return dense_block_mask(layout, sliding_window)
    if backend == "flex":
        mask_mod = block_mask_mod(layout, sliding_window)
        return block_mask_from_mask_mod(mask_mod, 1, layout.q_len, layout.kv_len, layout.anchors.device)
    raise ValueError(
        f"block-draft attention backend {backend!r} is unknown; choose 'sdpa', 'eager' or 'flex'"
    )


BLOCK_BACKENDS = ("auto", "sdpa", "eager", "flex")


def resolve_block_backend(requested: str, device: torch.device | str) -> str:
    """The block-draft mask form for ``device``: ``"auto"`` is a flex ``BlockMask`` where the target would
    run flex or flash (CUDA), else the dense SDPA mask; an explicit choice is kept."""
    if requested not in BLOCK_BACKENDS:
        raise ValueError(f"draft_attn_backend {requested!r} is unknown; choose one of {BLOCK_BACKENDS}")
    if requested == "auto":
        return "flex" if resolve_backend("auto", device) in ("flex", "flash") else "sdpa"
    return requested


def _check_window(sliding_window: int | None) -> None:
    if sliding_window is not None:
        SLIDING_WINDOW.check(sliding_window)
