"""Packing plans over document lengths and vectorised collation into contract batches.

Three modes (docs/concepts/packing.md#the-data-module-packedchatdatamodule), all producing batches that
``lightning_drafts.core.batch.validate_batch`` accepts, with trailing padding folded into each row's last
document:

* ``"buffer"``: best-fit-decreasing over a window of ``shuffle_buffer`` shuffled documents into rows of
  ``max_tokens``; rows are shuffled and grouped ``batch_size`` rows per micro-batch.
* ``"microbatch"``: the padded loader's micro-batches (same documents, same order of micro-batches), each
  packed into as few rows of capacity ``max_tokens`` as best-fit-decreasing finds (and only as wide as
  the fullest row), so every optimizer step sees the same logical batch and the same loss
  normalisation as the padded run (SpecForge semantics).
* ``"padded"`` (``packing=False``): one document per row, padded to the micro-batch's longest document.

A plan is computed from lengths alone (a Python loop over documents, never over tokens); collation
gathers a micro-batch's tokens with a handful of numpy index operations.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from lightning_drafts.datamodules.documents import Documents

PACKING_MODES = ("buffer", "microbatch", "padded")


def resolve_packing(packing: bool | str) -> str:
    """Map the user's ``packing`` value to a mode: ``True`` is ``"buffer"``, ``False`` is ``"padded"``."""
    if packing is True:
        return "buffer"
    if packing is False or packing == "padded":
        return "padded"
    if packing in PACKING_MODES:
        return packing
    raise ValueError(
        f"packing={packing!r} is not supported; use 'buffer' (or True), 'microbatch', or False for one "
        "document per padded row"
    )


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[np.ndarray]:
    """Pack items into bins of ``capacity``: each item, longest first, goes to the fullest bin it fits.

    Returns one array of item indices per bin, in bin-creation order. Every length must be in
    ``[1, capacity]``. The open bins are indexed by remaining capacity (a sorted list of distinct
    capacities plus a bucket per capacity), so each item costs one bisect.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and (lengths.min() < 1 or lengths.max() > capacity):
        raise ValueError(
            f"best_fit_decreasing needs lengths in [1, {capacity}], got [{lengths.min()}, {lengths.max()}]; "
            "truncate or drop documents longer than max_tokens first"
        )
    order = np.argsort(-lengths, kind="stable")
    bins: list[list[int]] = []
    free_sizes: list[int] = []
    by_free: dict[int, list[int]] = {}
    for item, size in zip(order.tolist(), lengths[order].tolist(), strict=True):
        slot = bisect_left(free_sizes, size)
        if slot < len(free_sizes):
            free = free_sizes[slot]
            bucket = by_free[free]
            target = bucket.pop()
            if not bucket:
                del by_free[free]
                free_sizes.pop(slot)
        else:
            free = capacity
            target = len(bins)
            bins.append([])
        bins[target].append(item)
        left = free - size
        if left > 0:
            if left not in by_free:
                by_free[left] = []
                insort(free_sizes, left)
            by_free[left].append(target)
    return [np.asarray(b, dtype=np.int64) for b in bins]


def deal_micro_batches(num_units: int, batch_size: int, world_size: int) -> np.ndarray:
    """Sizes ``[steps, world_size]`` of every rank's micro-batch at every step, in units (rows or documents).

    Units are consumed step-major, rank-minor, so one global step holds the same units whatever the world
    size. Every rank gets the same number of micro-batches (a rank with fewer would hang the others in a
    collective) and no unit is repeated or skipped: full micro-batches of ``batch_size``, the last step's
    remainder split evenly, and when that remainder is smaller than the world size it is folded into the
    previous step (those micro-batches get ``batch_size + 1`` units).
    """
    if batch_size < 1 or world_size < 1:
        raise ValueError(f"batch_size ({batch_size}) and world_size ({world_size}) must be at least 1")
    if num_units < world_size:
        raise ValueError(
            f"{num_units} packed rows/documents cannot give each of {world_size} ranks a micro-batch; use more "
            "data (or a larger validation split), fewer ranks, or a smaller max_tokens"
        )
    per_step = batch_size * world_size
    steps = -(-num_units // per_step)
    sizes = np.full((steps, world_size), batch_size, dtype=np.int64)
    tail = num_units - (steps - 1) * per_step
    if tail >= world_size:
        sizes[-1] = tail // world_size + (np.arange(world_size) < tail % world_size)
    else:
        sizes = sizes[:-1]
        sizes[-1, :tail] += 1
    return sizes


@dataclass(frozen=True)
class MicroBatchPlan:
    """One rank's micro-batches for one epoch, as flat arrays.

    Row ``r`` holds documents ``docs[row_bounds[r]:row_bounds[r + 1]]`` back to back; micro-batch ``i``
    holds rows ``batch_bounds[i]:batch_bounds[i + 1]``, each ``widths[i]`` tokens wide. ``units_after[i]``
    is how many units (rows or documents) of the epoch all ranks together have consumed once every rank
    has run its first ``i`` micro-batches: a position that means the same for any world size.
    """

    docs: np.ndarray
    row_bounds: np.ndarray
    batch_bounds: np.ndarray
    widths: np.ndarray
    units_after: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.widths.shape[0])

    def batch_documents(self, index: int) -> list[np.ndarray]:
        """Document indices of each row of micro-batch ``index``."""
        rows = range(int(self.batch_bounds[index]), int(self.batch_bounds[index + 1]))
        return [self.docs[self.row_bounds[r] : self.row_bounds[r + 1]] for r in rows]

    @classmethod
    def from_batches(
        cls, batches: list[list[np.ndarray]], widths: list[int], units_after: np.ndarray | None = None
    ) -> MicroBatchPlan:
        rows = [row for batch in batches for row in batch]
        row_sizes = np.array([len(row) for row in rows], dtype=np.int64)
        batch_sizes = np.array([len(batch) for batch in batches], dtype=np.int64)
        docs = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
        return cls(
            docs=docs.astype(np.int64),
            row_bounds=np.concatenate([[0], np.cumsum(row_sizes)]),
            batch_bounds=np.concatenate([[0], np.cumsum(batch_sizes)]),
            widths=np.asarray(widths, dtype=np.int64),
            units_after=units_after,
        )


def plan_epoch(
    lengths: np.ndarray,
    *,
    mode: str,
    max_tokens: int,
    batch_size: int,
    seed: int,
    epoch: int,
    shuffle: bool = True,
    shuffle_buffer: int = 10_000,
    world_size: int = 1,
    rank: int = 0,
    start: int = 0,
) -> MicroBatchPlan:
    """``rank``'s micro-batches of ``epoch``: a pure function of the lengths and these arguments.

    Every rank computes the same global plan and keeps its share, so ranks never overlap and together
    cover every document exactly once. ``lengths`` must already respect ``max_tokens``. The epoch's units
    (rows or documents) are ordered independently of the world size; ``start`` deals only the units after
    the first ``start`` (those an interrupted run already consumed, on whatever world size), so a resumed
    epoch uses each of its documents exactly once. At the world size that consumed them, a ``start`` that
    ends a step gives exactly the rest of the uninterrupted plan.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside [0, world_size={world_size})")
    if shuffle_buffer < 1:
        raise ValueError(f"shuffle_buffer={shuffle_buffer} must be at least 1 document")
    lengths = np.asarray(lengths, dtype=np.int64)
    rng = np.random.default_rng((seed, epoch))
    order = rng.permutation(len(lengths)) if shuffle else np.arange(len(lengths))

    units: list[np.ndarray] | np.ndarray
    if mode == "buffer":
        units = []
        for begin in range(0, len(order), shuffle_buffer):
            window = order[begin : begin + shuffle_buffer]
            units.extend(window[b] for b in best_fit_decreasing(lengths[window], max_tokens))
        if shuffle:
            # Best-fit-decreasing creates rows longest-document-first; without this shuffle, early
            # micro-batches would hold all the long documents.
            units = [units[i] for i in rng.permutation(len(units))]
    elif mode in ("microbatch", "padded"):
        units = order
    else:
        raise ValueError(f"mode={mode!r} is not one of {PACKING_MODES}")

    if not 0 <= start <= len(units):
        raise ValueError(f"start={start} is outside the epoch's {len(units)} packed rows/documents")
    if start == len(units):  # the epoch was consumed to its end
        return MicroBatchPlan.from_batches([], [], np.array([start], dtype=np.int64))
    units = units[start:]
    sizes = deal_micro_batches(len(units), batch_size, world_size)
    bounds = np.concatenate([[0], np.cumsum(sizes.ravel())])
    batches: list[list[np.ndarray]] = []
    widths: list[int] = []
    for step in range(sizes.shape[0]):
        slot = step * world_size + rank
        chosen = units[bounds[slot] : bounds[slot + 1]]
        if mode == "buffer":
            batches.append(chosen)
            widths.append(max_tokens)
        else:
            docs = chosen
            if mode == "microbatch":
                rows = [docs[b] for b in best_fit_decreasing(lengths[docs], max_tokens)]
                batches.append(rows)
                # Rows are only as wide as the fullest one: a micro-batch of a few short documents
                # would otherwise pay for max_tokens columns of padding.
                widths.append(max(int(lengths[row].sum()) for row in rows))
            else:
                batches.append([docs[i : i + 1] for i in range(len(docs))])
                widths.append(int(lengths[docs].max()))
    units_after = start + np.concatenate([[0], np.cumsum(sizes.sum(axis=1))])
    return MicroBatchPlan.from_batches(batches, widths, units_after)


@dataclass(frozen=True)
class Placement:
    """Where micro-batch ``index`` of a plan puts its documents' tokens, as flat ``[R * W]`` indices.

    ``docs`` are the documents in row order; ``target`` holds the flat slot of each of their tokens,
    document after document (so a per-document array concatenated in ``docs`` order lands with
    ``out[target] = values``); ``doc_base[j]`` is the flat slot of document ``j``'s first token.
    """

    docs: np.ndarray
    lengths: np.ndarray
    source: np.ndarray
    target: np.ndarray
    doc_base: np.ndarray
    within: np.ndarray
    row_of_doc: np.ndarray
    column: np.ndarray
    docs_per_row: np.ndarray
    first_doc: np.ndarray
    num_rows: int
    width: int


def place(documents: Documents, plan: MicroBatchPlan, index: int) -> Placement:
    """The token placement of micro-batch ``index`` of ``plan``."""
    r0, r1 = int(plan.batch_bounds[index]), int(plan.batch_bounds[index + 1])
    d0 = int(plan.row_bounds[r0])
    docs = plan.docs[d0 : plan.row_bounds[r1]]
    num_rows, width = r1 - r0, int(plan.widths[index])
    docs_per_row = np.diff(plan.row_bounds[r0 : r1 + 1])
    row_of_doc = np.repeat(np.arange(num_rows), docs_per_row)
    first_doc = plan.row_bounds[r0:r1] - d0

    lengths = documents.lengths[docs]
    ends = np.cumsum(lengths)
    begins = ends - lengths
    column = begins - begins[first_doc][row_of_doc]
    within = np.arange(int(ends[-1])) - np.repeat(begins, lengths)
    source = np.repeat(documents.starts[docs], lengths) + within
    doc_base = row_of_doc * width + column
    target = np.repeat(doc_base, lengths) + within
    return Placement(
        docs=docs,
        lengths=lengths,
        source=source,
        target=target,
        doc_base=doc_base,
        within=within,
        row_of_doc=row_of_doc,
        column=column,
        docs_per_row=docs_per_row,
        first_doc=first_doc,
        num_rows=num_rows,
        width=width,
    )


def collate(documents: Documents, plan: MicroBatchPlan, index: int, pad_token_id: int) -> dict[str, Tensor]:
    """Micro-batch ``index`` of ``plan`` as a contract batch of long tensors ``[R, W]`` (``seq_lens`` ``[R, D]``)."""
    return collate_placed(documents, place(documents, plan, index), pad_token_id)


def collate_placed(documents: Documents, placement: Placement, pad_token_id: int) -> dict[str, Tensor]:
    """The contract batch of a :class:`Placement`."""
    p = placement
    num_rows, width, target, source, within, lengths = (
        p.num_rows, p.width, p.target, p.source, p.within, p.lengths
    )  # fmt: skip
    last_doc = p.first_doc + p.docs_per_row - 1

    input_ids = np.full(num_rows * width, pad_token_id, dtype=np.int64)
    input_ids[target] = documents.input_ids[source]
    loss_mask = np.zeros(num_rows * width, dtype=np.int64)
    loss_mask[target] = documents.loss_mask[source]
    attention_mask = np.zeros(num_rows * width, dtype=np.int64)
    attention_mask[target] = 1
    # Pad slots continue the row's last document's position counter (the contract folds them into it).
    position_ids = (np.arange(width)[None, :] - p.column[last_doc][:, None]).ravel()
    position_ids[target] = within
    doc_remaining = np.zeros(num_rows * width, dtype=np.int64)
    doc_remaining[target] = np.repeat(lengths - 1, lengths) - within

    seq_lens = np.zeros((num_rows, int(p.docs_per_row.max())), dtype=np.int64)
    seq_lens[p.row_of_doc, np.arange(len(p.docs)) - p.first_doc[p.row_of_doc]] = lengths
    used = np.bincount(p.row_of_doc, weights=lengths, minlength=num_rows).astype(np.int64)
    seq_lens[np.arange(num_rows), p.docs_per_row - 1] += width - used

    shape = (num_rows, width)
    return {
        "input_ids": torch.from_numpy(input_ids.reshape(shape)),
        "attention_mask": torch.from_numpy(attention_mask.reshape(shape)),
        "loss_mask": torch.from_numpy(loss_mask.reshape(shape)),
        "position_ids": torch.from_numpy(position_ids.reshape(shape)),
        "seq_lens": torch.from_numpy(seq_lens),
        "doc_remaining": torch.from_numpy(doc_remaining.reshape(shape)),
    }
