"""Per-block loss terms over chunks of blocks, so ``[blocks, slots, V]`` logits never exist whole.

Block drafts (DFlash, DFlash2, DSpark) project every block slot onto the full vocabulary. Running the
terms chunk by chunk under non-reentrant activation checkpointing keeps one chunk's logits alive at a
time: each chunk's logits are recomputed in backward instead of kept.

The last chunk is not checkpointed: backward reaches it first, so its kept activations are freed before
any other chunk is recomputed, and the peak stays one chunk. Putting the remainder chunk first makes
the kept chunk a full one, so a micro-batch of ``blocks`` recomputes only ``blocks - chunk_blocks`` of
them (a packed micro-batch, which holds more blocks than a padded one, would otherwise pay a whole
extra forward of its logits).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def over_chunks(
    terms: Callable[..., tuple[Tensor, ...]], chunk_blocks: int | None, *per_block: Tensor
) -> list[Tensor]:
    """Run ``terms`` on chunks of ``chunk_blocks`` blocks (None = one piece) of the ``per_block`` tensors.

    Scalar outputs of ``terms`` are summed over chunks, per-block outputs concatenated in block order.
    """
    blocks = per_block[0].shape[0]
    size = chunk_blocks or blocks
    bounds = chunk_bounds(blocks, size)
    results = []
    for index, (start, stop) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        chunk = [tensor[start:stop] for tensor in per_block]
        if torch.is_grad_enabled() and index < len(bounds) - 2:
            results.append(torch.utils.checkpoint.checkpoint(terms, *chunk, use_reentrant=False))
        else:
            results.append(terms(*chunk))
    return [
        torch.stack(parts).sum() if parts[0].dim() == 0 else torch.cat(parts)
        for parts in zip(*results, strict=True)
    ]


def chunk_bounds(blocks: int, size: int) -> list[int]:
    """``[0, ..., blocks]``: chunks of ``size`` blocks with the remainder (if any) first."""
    if blocks == 0:
        return [0]
    return [0, *range(blocks % size or size, blocks + 1, size)]
