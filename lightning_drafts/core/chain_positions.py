"""The chain positions a block draft's vocabulary terms run at: the supervised ones, or every one.

Block drafts (DFlash, DFlash2, DSpark) project each chain position (a block slot that predicts a token)
onto the vocabulary, and its logits, loss terms and argmax depend on that position alone. An
unsupervised position has weight 0 in every loss term and counts in no statistic (acceptance counts
read ``correct & valid``), so computing them only at the supervised positions, gathered into one flat
``[n, ...]`` row, leaves the loss, every gradient and every statistic as they were and skips the
vocabulary projection of the rest. The skipped positions' slot states still feed their block's other
slots through attention: only per-position work can be left out, never the slot itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class ChainPositions:
    """The positions kept out of ``[m, D]`` chains: ``index`` holds their flat ``i * D + j`` indices in
    ascending order, or None for every position (the flat view, nothing copied)."""

    shape: tuple[int, int]
    index: Tensor | None

    @classmethod
    def of(cls, valid: Tensor, supervised_only: bool, count: int | None = None) -> ChainPositions:
        """The supervised positions of bool ``valid [m, D]`` (every position when not ``supervised_only``).

        ``count``, their number when the caller knows it (:func:`supervised_per_chain` read once for every
        chunk of a step), sizes the index without reading ``valid`` back: on CUDA, ``nonzero`` waits for the
        device to learn its output's size, once per logits chunk otherwise."""
        if valid.dim() != 2:
            raise ValueError(f"valid must be [m, D] chains, got shape {tuple(valid.shape)}")
        flat = valid.reshape(-1)
        if not supervised_only:
            index = None
        elif count is None:
            index = flat.nonzero().squeeze(1)
        else:
            index = torch.nonzero_static(flat, size=count).squeeze(1)
        return cls((int(valid.shape[0]), int(valid.shape[1])), index)

    @property
    def count(self) -> int:
        return self.shape[0] * self.shape[1] if self.index is None else int(self.index.numel())

    def gather(self, per_position: Tensor) -> Tensor:
        """``[m, D, ...]`` -> ``[n, ...]`` at the kept positions (differentiable)."""
        if tuple(per_position.shape[:2]) != self.shape:
            raise ValueError(
                f"expected a [{self.shape[0]}, {self.shape[1]}, ...] tensor, got shape {tuple(per_position.shape)}"
            )
        flat = per_position.flatten(0, 1)
        return flat if self.index is None else flat.index_select(0, self.index)

    def scatter(self, values: Tensor, fill: float | int | bool = 0) -> Tensor:
        """``[n, ...]`` -> ``[m, D, ...]``, ``fill`` at the positions left out (differentiable in ``values``).

        The fill must be a value every reader ignores at an unsupervised position (it is multiplied by a
        zero weight or masked by ``valid``), and finite: ``0 * inf`` would be NaN.
        """
        if values.shape[0] != self.count:
            raise ValueError(f"expected {self.count} values (one per kept position), got {values.shape[0]}")
        trailing = tuple(values.shape[1:])
        if self.index is None:
            return values.view(*self.shape, *trailing)
        full = torch.full(
            (self.shape[0] * self.shape[1], *trailing), fill, dtype=values.dtype, device=values.device
        )
        return full.index_copy(0, self.index, values).view(*self.shape, *trailing)


def supervised_per_chain(valid: Tensor) -> Tensor:
    """The supervised positions of each chain of bool ``valid [m, D]``, on the host: one read of the device
    for a whole step, after which each chunk's count (``int(counts[start:stop].sum())``) is host arithmetic
    (the chunks of :func:`~lightning_drafts.core.chunked_terms.over_chunks` slice it with the chains)."""
    return valid.sum(dim=1).cpu()
