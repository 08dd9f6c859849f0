"""The DFlash objective: block targets, decay-weighted cross-entropy, variable-prefix option.

Block slot k of the block anchored at a predicts the token at a + k ("same-position prediction",
docs/concepts/dflash.md#the-draft, docs/concepts/dflash.md#objective). Slots ``< known`` hold real tokens
(just the anchor for DFlash; a random prefix under ``variable_prefix``); the draft predicts the rest. One
chain per block (docs/concepts/dflash.md#chains-and-acceptance): chain index j is block slot ``known + j``, so
chain position 0 is always the first drafted token and the acceptance statistics count the leading run of
correct drafts after what the draft was given.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_drafts.attention.block_masks import BlockLayout
from lightning_drafts.core.batch import PackedBatch

LOSS_EPS = 1e-6
# Blocks per document in the training estimate of an export: enough that every valid anchor of a served
# generation is used, so the estimate does not depend on the anchor sampler's draw.
ESTIMATE_ANCHORS = 512


@dataclass(frozen=True)
class BlockTargets:
    """Per chain (``[M, D]``, ``D = block_size - 1``): the gold token, whether it is supervised, and the
    block slot whose hidden state predicts it (clamped in range where the chain ran out of block)."""

    labels: Tensor
    valid: Tensor
    slots: Tensor

    def select(self, kept: Tensor) -> BlockTargets:
        """The chains of the blocks ``kept`` (bool ``[M]``)."""
        return BlockTargets(labels=self.labels[kept], valid=self.valid[kept], slots=self.slots[kept])


def block_targets(packed: PackedBatch, layout: BlockLayout, known: Tensor) -> BlockTargets:
    """Chain j of block m predicts row position ``anchor + known + j``.

    Valid iff that slot is inside the block, inside the anchor's document and supervised. Labels are
    gathered by row offset, so the document bound is what keeps a label from another document out.
    """
    size = layout.block_size
    slots = known[:, None] + torch.arange(size - 1, device=known.device)
    in_block = slots < size
    in_document = slots <= packed.doc_remaining[layout.rows, layout.anchors][:, None]
    rows = layout.rows[:, None]
    positions = (layout.anchors[:, None] + slots).clamp(max=layout.width - 1)
    valid = in_block & in_document & packed.loss_mask[rows, positions]
    return BlockTargets(
        labels=packed.input_ids[rows, positions], valid=valid, slots=slots.clamp(max=size - 1)
    )


def chain_hidden(hidden: Tensor, targets: BlockTargets) -> Tensor:
    """``[M, bs, H]`` slot states -> ``[M, D, H]`` the states that predict each chain position."""
    return hidden.gather(1, targets.slots[..., None].expand(-1, -1, hidden.shape[-1]))


def decay_weights(length: int, gamma: float | None, device: torch.device | str | None = None) -> Tensor:
    """``exp(-j / gamma)`` for chain positions j = 0 .. length-1 (first drafted token weight 1);
    uniform when ``gamma`` is None (paper Eq. 4; γ = 7 / 5 / 4 for block sizes 16 / 10 / 8)."""
    steps = torch.arange(length, dtype=torch.float32, device=device)
    return torch.ones_like(steps) if gamma is None else torch.exp(-steps / gamma)


def sample_prefix_lengths(
    count: int,
    block_size: int,
    base: float,
    generator: torch.Generator | None = None,
    device: torch.device | None = None,
) -> Tensor:
    """Variable-prefix lengths (D2SD VP-Drafter, docs/concepts/dflash.md#variable-prefix): ``l`` in
    ``[min(2, bs-1), bs-1]`` with ``P(l) ∝ base ** l``, drawn with replacement, one per block."""
    low = min(2, block_size - 1)
    lengths = torch.arange(low, block_size, dtype=torch.float64)
    choice = torch.multinomial(base**lengths, count, replacement=True, generator=generator)
    return (choice + low).to(device)


def check_prefix_lengths(prefix_lengths: Tensor, anchors: Tensor, block_size: int) -> Tensor:
    """Explicit variable-prefix lengths, ``[B, N]`` aligned with the anchors they belong to."""
    if not isinstance(prefix_lengths, Tensor) or prefix_lengths.shape != anchors.shape:
        got = (
            tuple(prefix_lengths.shape)
            if isinstance(prefix_lengths, Tensor)
            else type(prefix_lengths).__name__
        )
        raise ValueError(
            f"prefix_lengths must be a tensor shaped like anchors {tuple(anchors.shape)}, got {got}"
        )
    prefix_lengths = prefix_lengths.long().to(anchors.device)
    low = min(2, block_size - 1)
    bad = (anchors >= 0) & ((prefix_lengths < low) | (prefix_lengths > block_size - 1))
    if bad.any():
        b, n = bad.nonzero()[0].tolist()
        raise ValueError(
            f"prefix_lengths[{b}, {n}] = {int(prefix_lengths[b, n])} is outside [{low}, {block_size - 1}] "
            f"for block_size {block_size}"
        )
    return prefix_lengths
