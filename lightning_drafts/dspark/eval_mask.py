"""What each DSpark block slot is supervised on (docs/concepts/dspark.md#supervised-slots).

Slot k of the block anchored at ``a`` predicts the token at ``a + k + 1`` (the shifted convention: slot
0, the clean anchor, IS supervised, so a block yields K proposals). Slot k counts iff its label lies
inside the row, is supervised, and stays inside the anchor's document (``k + 1 <= doc_remaining[a]``);
the document term is applied BEFORE the cumulative product, so a block that crosses its document's end
becomes a partial in-document block, exactly like a block cut by the row end. After the product the
mask is a prefix: supervision is the longest contiguous enabled run from slot 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_drafts.attention.block_masks import BlockLayout
from lightning_drafts.core.batch import PackedBatch


@dataclass(frozen=True)
class BlockSupervision:
    """Per block slot, ``[M, K]`` each.

    ``labels``: the token at ``anchor + k + 1`` (clamped into the row where it runs past the end);
    ``valid``: the eval mask; ``previous``: the teacher-forced previous token of the Markov head (the
    token at ``anchor + k``); ``teacher_positions``: the row position whose next-token distribution is
    the slot's teacher (``anchor + k``, clamped). Values at invalid slots are placeholders.
    """

    labels: Tensor
    valid: Tensor
    previous: Tensor
    teacher_positions: Tensor


def build_eval_mask(
    loss_mask: Tensor, doc_remaining: Tensor, rows: Tensor, anchors: Tensor, block_size: int
) -> Tensor:
    """Bool ``[M, K]`` eval mask of the blocks at ``(rows[m], anchors[m])`` of ``[B, T]`` ``loss_mask`` /
    ``doc_remaining``."""
    width = loss_mask.shape[1]
    steps = torch.arange(1, block_size + 1, device=anchors.device)
    labels = anchors[:, None] + steps
    in_row = labels < width
    supervised = loss_mask[rows[:, None], labels.clamp(max=width - 1)].bool()
    in_document = steps <= doc_remaining[rows, anchors][:, None]
    return (in_row & supervised & in_document).long().cumprod(dim=1).bool()


def block_supervision(packed: PackedBatch, layout: BlockLayout) -> BlockSupervision:
    """Labels, eval mask, previous tokens and teacher positions of every block of ``layout``."""
    size, width = layout.block_size, layout.width
    rows = layout.rows[:, None]
    positions = layout.block_row_positions()
    valid = build_eval_mask(packed.loss_mask, packed.doc_remaining, layout.rows, layout.anchors, size)
    return BlockSupervision(
        labels=packed.input_ids[rows, (positions + 1).clamp(max=width - 1)],
        valid=valid,
        previous=packed.input_ids[rows, positions.clamp(max=width - 1)],
        teacher_positions=positions.clamp(max=width - 1),
    )
