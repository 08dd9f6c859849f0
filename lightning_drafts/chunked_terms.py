"""Per-block loss terms over chunks of blocks, so ``[blocks, slots, V]`` logits never exist whole.

Block drafts (DFlash, DFlash2, DSpark) project every block slot onto the full vocabulary. Running the
terms chunk by chunk under non-reentrant activation checkpointing keeps one chunk's logits alive at a
time: each chunk's logits are recomputed in backward instead of kept.
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
    checkpointed = torch.is_grad_enabled() and blocks > size
    results = []
    for start in range(0, blocks, size):
        chunk = [tensor[start : start + size] for tensor in per_block]
        if checkpointed:
            results.append(torch.utils.checkpoint.checkpoint(terms, *chunk, use_reentrant=False))
        else:
            results.append(terms(*chunk))
    return [
        torch.stack(parts).sum() if parts[0].dim() == 0 else torch.cat(parts)
        for parts in zip(*results, strict=True)
    ]
