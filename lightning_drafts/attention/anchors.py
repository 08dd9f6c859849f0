"""Anchors of block drafts (DFlash, DFlash2, DSpark): the row positions where a draft block starts.

An anchor is a real, supervised token; its block holds that token followed by ``block_size - 1``
slots the draft fills in. The contract budgets anchors **per document** (``min(num_anchors, valid
anchors of that document)``) so packing several documents into one row never thins any document's
training signal, and a packed batch samples exactly the anchors its padded twin would.

Anchors travel as ``[B, N]`` row positions (``-1`` = no anchor; each row's anchors ascending, ``N``
= the largest per-row count). :func:`flatten_anchors` lays the blocks of all rows back to back,
without padding every row to the busiest one.

Everything is tensor ops over ``[B, T]``: no Python loop over tokens, documents or rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_drafts.core.batch import PackedBatch
from lightning_drafts.core.checks import check_int


@dataclass(frozen=True)
class AnchorBlocks:
    """The anchors of a micro-batch, one entry per block, row-major (row, then column of ``[B, N]``).

    ``slots[m]`` is the column of block m in the ``[B, N]`` anchors tensor, so per-anchor inputs given
    in the same ``[B, N]`` layout (e.g. DFlash's variable-prefix lengths) can follow their block.
    """

    rows: Tensor
    positions: Tensor
    slots: Tensor

    @property
    def count(self) -> int:
        return int(self.rows.numel())


def anchor_candidates(packed: PackedBatch, block_size: int, partial_blocks: bool = False) -> Tensor:
    """Bool ``[B, T]``: True where a block may start.

    Whole blocks (``partial_blocks=False``, DFlash / DFlash2, docs/concepts/dflash.md#anchors): the anchor is
    supervised and the block's last position ``t + block_size - 1`` is a real token of the same
    document (``doc_remaining[t] >= block_size - 1``; this implies ``t <= T - block_size``), so a
    document shorter than a block gives none.

    Partial blocks (``partial_blocks=True``, DSpark, docs/concepts/dspark.md#supervised-slots): the anchor and
    the next token are supervised and the next token is in the same document (``doc_remaining[t] >= 1``); the
    block's supervision is truncated at the document end by the caller.
    """
    check_int("block_size", block_size, 1)
    supervised = packed.loss_mask
    if partial_blocks:
        next_supervised = torch.zeros_like(supervised)
        next_supervised[:, :-1] = supervised[:, 1:]
        return supervised & next_supervised & (packed.doc_remaining >= 1)
    return supervised & (packed.doc_remaining >= block_size - 1)


def sample_anchors(
    packed: PackedBatch,
    block_size: int,
    num_anchors: int,
    generator: torch.Generator | None = None,
    partial_blocks: bool = False,
) -> Tensor:
    """Draw ``min(num_anchors, candidates of the document)`` anchors per document, uniformly without
    replacement, and return them as long ``[B, N]`` row positions (``-1`` = none, rows ascending).

    One uniform draw per row position (``[B * T]`` from ``generator``, or the global RNG) orders the
    candidates; each document keeps its lowest-drawn ``num_anchors``. A document without candidates
    (e.g. shorter than a block) simply gets none: see :func:`documents_shorter_than` to count them.
    """
    check_int("num_anchors", num_anchors, 1, hint="anchors per document")
    candidates = anchor_candidates(packed, block_size, partial_blocks)
    batch, width = packed.shape
    device = candidates.device
    flat = candidates.reshape(-1).nonzero().squeeze(1)
    noise_device = generator.device if generator is not None else device
    noise = torch.rand(batch * width, generator=generator, device=noise_device).to(device)[flat]

    # Documents are contiguous, so (row, document start) names a document uniquely.
    rows = torch.arange(batch, device=device)[:, None]
    document = (rows * width + packed.doc_start).reshape(-1)[flat]
    order = noise.argsort()
    order = order[document[order].argsort(stable=True)]
    kept = flat[order[_rank_within_groups(document[order]) < num_anchors]].sort().values
    return anchors_from_positions(kept // width, kept % width, batch)


def anchors_from_positions(rows: Tensor, positions: Tensor, batch: int) -> Tensor:
    """Long ``[B, N]`` anchors (``-1`` padded, each row ascending) from flat ``rows`` / ``positions``."""
    device = positions.device
    if rows.numel() == 0:
        return torch.empty(batch, 0, dtype=torch.long, device=device)
    span = int(positions.max()) + 1
    order = (rows * span + positions).argsort()
    rows, positions = rows[order], positions[order]
    counts = torch.bincount(rows, minlength=batch)
    first = counts.cumsum(0) - counts
    slots = torch.arange(rows.numel(), device=device) - first[rows]
    anchors = torch.full((batch, int(counts.max())), -1, dtype=torch.long, device=device)
    anchors[rows, slots] = positions.long()
    return anchors


def flatten_anchors(anchors: Tensor) -> AnchorBlocks:
    """The blocks of ``[B, N]`` anchors back to back (row-major): no row is padded to the busiest one."""
    rows, slots = (anchors >= 0).nonzero(as_tuple=True)
    return AnchorBlocks(rows=rows, positions=anchors[rows, slots], slots=slots)


def check_anchors(
    packed: PackedBatch, anchors: Tensor, block_size: int, partial_blocks: bool = False
) -> Tensor:
    """Validate explicit anchors against the same rules :func:`sample_anchors` follows.

    Returns them as long ``[B, N]``. The per-document budget is not enforced: explicit anchors are the
    caller's choice (tests place them by hand; overlapping anchors are legal).
    """
    batch, width = packed.shape
    if not isinstance(anchors, Tensor) or anchors.dim() != 2 or anchors.shape[0] != batch:
        got = tuple(anchors.shape) if isinstance(anchors, Tensor) else type(anchors).__name__
        raise ValueError(f"anchors must be a [B, N] = [{batch}, N] tensor of row positions, got {got}")
    if anchors.dtype.is_floating_point or anchors.dtype == torch.bool:
        raise ValueError(f"anchors must hold integer row positions (-1 = none), got dtype {anchors.dtype}")
    anchors = anchors.long().to(packed.input_ids.device)
    outside = (anchors < -1) | (anchors >= width)
    if outside.any():
        b, n = outside.nonzero()[0].tolist()
        raise ValueError(
            f"anchors[{b}, {n}] = {int(anchors[b, n])} is outside the row [0, {width}); use -1 for no anchor"
        )
    blocks = flatten_anchors(anchors)
    allowed = anchor_candidates(packed, block_size, partial_blocks)[blocks.rows, blocks.positions]
    if not allowed.all():
        m = int((~allowed).nonzero()[0])
        b, t = int(blocks.rows[m]), int(blocks.positions[m])
        rule = (
            "the anchor and the next token must be supervised and in one document"
            if partial_blocks
            else f"the anchor must be supervised and its whole block of {block_size} inside its document"
        )
        raise ValueError(
            f"anchor {t} in row {b} is not a valid anchor (loss_mask = {int(packed.loss_mask[b, t])}, "
            f"doc_remaining = {int(packed.doc_remaining[b, t])}): {rule}"
        )
    return anchors


def documents_shorter_than(packed: PackedBatch, length: int) -> Tensor:
    """How many documents hold between 1 and ``length - 1`` real tokens (they can hold no whole block)."""
    real = torch.zeros(packed.seq_lens.shape, dtype=torch.long, device=packed.seq_lens.device)
    real.scatter_add_(1, packed.doc_ids, packed.attention_mask.long())
    return ((real > 0) & (real < length)).sum()


def _rank_within_groups(keys: Tensor) -> Tensor:
    """0, 1, 2, ... inside each run of equal consecutive ``keys``."""
    index = torch.arange(keys.numel(), device=keys.device)
    starts = torch.ones_like(keys, dtype=torch.bool)
    starts[1:] = keys[1:] != keys[:-1]
    return index - torch.where(starts, index, 0).cummax(0).values
