"""The largest entries of each row of a vocabulary-wide ``[n, V]`` tensor, found through block maxima.

``max(dim)`` and ``topk`` carry an index through every comparison and run 3-4x slower on the CPU than a
plain ``amax``. So on the CPU each block of :data:`BLOCK` consecutive columns is reduced with ``amax``
first, and the index is searched only inside the few blocks that can hold the answer: ``V / BLOCK``
maxima and a block or ``k`` blocks instead of ``V`` indexed comparisons per row. Elsewhere ``max`` and
``topk`` are one fast kernel each, and the blocks would only add launches: they run as they are.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Columns per block: a block's maximum is one vectorised reduction, and a row's blocks stay few.
BLOCK = 128


def row_max(values: Tensor) -> tuple[Tensor, Tensor]:
    """``values.max(dim=-1)`` of ``[n, V]`` values, bit for bit: each row's maximum and its first id (a NaN
    counts as the maximum).

    The row's first block holding the maximum is the first maximal block maximum, and the first maximal id
    of the row lies inside it; the columns after the last whole block are searched directly and win only
    when strictly larger.
    """
    rows, vocab = values.shape
    blocks = vocab // BLOCK
    if blocks < 2 or values.device.type != "cpu":
        return values.max(dim=-1)
    whole = values[:, : blocks * BLOCK].unflatten(-1, (blocks, BLOCK))
    block = whole.amax(dim=-1).max(dim=-1).indices
    inside = whole.gather(1, block[:, None, None].expand(rows, 1, BLOCK)).squeeze(1).max(dim=-1).indices
    predicted = block * BLOCK + inside
    if blocks * BLOCK < vocab:
        tail_top, tail_index = values[:, blocks * BLOCK :].max(dim=-1)
        top = values.gather(-1, predicted[:, None]).squeeze(-1)
        later = (tail_top > top) | (tail_top.isnan() & ~top.isnan())
        predicted = torch.where(later, tail_index + blocks * BLOCK, predicted)
    # The element itself, not a block's amax: of a tied -0.0 and +0.0 it is the first one's sign.
    return values.gather(-1, predicted[:, None]).squeeze(-1), predicted


def row_topk(values: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """``values.topk(k, dim=-1)`` of ``[n, V]`` values: the same values in the same order, and ids of the
    same entries wherever the values are distinct (among tied values ``topk`` fixes no order either).

    The ``k`` blocks with the largest maxima hold the ``k`` largest entries: an entry outside them is
    exceeded or equalled by each of their ``k`` maxima. So ``topk`` runs over those blocks' columns (in
    the vocabulary's order) and the columns after the last whole block.
    """
    rows, vocab = values.shape
    blocks = vocab // BLOCK
    if blocks <= k or values.device.type != "cpu":
        return values.topk(k, dim=-1)
    whole = values[:, : blocks * BLOCK].unflatten(-1, (blocks, BLOCK))
    chosen = whole.amax(dim=-1).topk(k, dim=-1).indices.sort(dim=-1).values
    columns = whole.gather(1, chosen[..., None].expand(rows, k, BLOCK)).flatten(1)
    ids = (chosen[..., None] * BLOCK + torch.arange(BLOCK, device=values.device)).flatten(1)
    if blocks * BLOCK < vocab:
        columns = torch.cat([columns, values[:, blocks * BLOCK :]], dim=1)
        tail = torch.arange(blocks * BLOCK, vocab, device=values.device)
        ids = torch.cat([ids, tail.expand(rows, -1)], dim=1)
    top, local = columns.topk(k, dim=-1)
    return top, ids.gather(1, local)
