"""``torch.unique`` with its size known on the host, for the chunks of a step.

``torch.unique`` must read the device to learn how many distinct values it returns: on CUDA a wait for
every queued kernel, once per call. A block draft that projects each distinct value of a logits chunk
once (DSpark's teacher positions and previous tokens) would wait once per chunk. Here the distinct values
of every chunk are counted on the device in one pass over the whole step (:func:`first_seen_per_chain`),
read back with the step's other sizes, and each chunk's unique then runs at a known size
(:func:`sorted_unique`), equal to ``torch.unique(values, return_inverse=True)``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def sorted_unique(values: Tensor, count: int) -> tuple[Tensor, Tensor]:
    """``torch.unique(values, return_inverse=True)`` of 1-D ``values`` holding ``count`` distinct values:
    the distinct values ascending and, per element, the index of its value among them."""
    ordered, order = values.sort(stable=True)
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[1:] = ordered[1:] != ordered[:-1]
    distinct = ordered[torch.nonzero_static(first, size=count).squeeze(1)]
    inverse = torch.empty_like(order).scatter_(0, order, first.cumsum(0) - 1)
    return distinct, inverse


def first_seen_per_chain(values: Tensor, kept: Tensor, bounds: list[int], span: int) -> Tensor:
    """For chains ``values [m, D]`` (integers in ``[0, span)``) at the positions ``kept [m, D]`` (bool), cut
    into chunks of chains at ``bounds`` (``[0, ..., m]``): per chain, how many values are seen in its chunk
    for the first time at that chain. A chunk's sum is its number of distinct kept values. Nothing is read
    back from the device."""
    chains, width = values.shape
    chunk = _chunk_of_chain(bounds, values.device)
    # One key per (chunk, value); positions left out share one key past every real one.
    past = (len(bounds) - 1) * span
    keys = torch.where(kept, chunk[:, None] * span + values, past).reshape(-1)
    ordered, order = keys.sort(stable=True)
    first = torch.ones_like(ordered, dtype=torch.bool)
    first[1:] = ordered[1:] != ordered[:-1]
    first &= ordered < past
    # Stable: the first of equal keys is the earliest position, in the earliest chain of the chunk.
    return torch.zeros(chains, dtype=torch.long, device=values.device).index_add_(
        0, order // width, first.long()
    )


def _chunk_of_chain(bounds: list[int], device: torch.device) -> Tensor:
    """The chunk of each chain for :func:`~lightning_drafts.core.chunked_terms.chunk_bounds`' cut (a first
    chunk, then chunks of one size), computed on the device from host integers (no copy to it)."""
    first = bounds[1] if len(bounds) > 1 else 0
    size = bounds[2] - bounds[1] if len(bounds) > 2 else max(first, 1)
    if any(b - a != size for a, b in zip(bounds[1:-1], bounds[2:], strict=True)):
        raise ValueError(f"chunk bounds {bounds} are not a first chunk then chunks of one size")
    chain = torch.arange(bounds[-1], device=device)
    return torch.where(chain < first, 0, 1 + (chain - first).div(size, rounding_mode="floor"))
