"""PlannedUnits: the units a train or validation loader is about to yield, known from its plan.

The loaders of :mod:`lightning_drafts.datamodules.loader` hand out micro-batch ``skip``, ``skip + 1``, ...
of an epoch's deterministic plan, and item ``i`` of their dataset is micro-batch ``i``. So the batch the
trainer receives next is item ``cursor`` and the ones after it can be built (and their target features
asked for) before the loader reaches them. A resumed run starts at the loader's ``skip``: the units after
the checkpoint's step are planned again, and none before it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_drafts.core.target_features import FeatureRequest
from lightning_drafts.training.remote.unit_ledger import Unit


class PlannedUnits:
    """Units of one pass of ``dataset`` (a planned-micro-batch dataset with ``epoch``, ``skip`` and
    ``plan``) for ``rank``, from its ``skip`` on; ``accumulate`` micro-batches make an optimizer step; the
    pass ends after ``limit`` batches (the trainer's ``limit_*_batches``) if that comes first."""

    def __init__(
        self, split: str, dataset: Any, epoch: int, rank: int, accumulate: int, limit: float | None = None
    ) -> None:
        for needed in ("skip", "plan", "documents"):
            if not hasattr(dataset, needed):
                raise ValueError(
                    f"a remote target needs the loader of planned micro-batches (PackedChatDataModule's); the "
                    f"{split} loader's dataset {type(dataset).__name__} has no {needed!r}"
                )
        self.split = split
        self.dataset = dataset
        self.epoch = int(epoch)
        self.rank = int(rank)
        self.accumulate = max(int(accumulate), 1)
        self.cursor = int(getattr(dataset, "skip", 0)) if split == "train" else 0
        self.end = len(dataset) if limit is None or limit == float("inf") else min(len(dataset), int(limit))

    def unit(self, index: int) -> Unit:
        step, micro = divmod(int(index), self.accumulate)
        return Unit(self.split, self.epoch, step, self.rank, micro)

    def index(self, unit: Unit) -> int:
        return unit.step * self.accumulate + unit.micro

    def advance(self) -> int:
        """The index of the batch the loader yields now."""
        index, self.cursor = self.cursor, self.cursor + 1
        return index

    def upcoming(self, depth: int) -> Iterator[int]:
        """Indices of the ``depth`` batches after the current one, within the pass."""
        return iter(range(self.cursor, min(self.cursor + depth, self.end)))

    def rows(self, index: int) -> dict[str, Tensor]:
        """The contract keys of micro-batch ``index`` (what the loader will yield, without features)."""
        return {k: v for k, v in self.dataset[index].items() if not k.startswith("target_")}

    def describe(self, unit: Unit) -> str:
        """The unit's documents: their indices in the split and their lengths."""
        rows = self.dataset.plan(self.dataset.epoch).batch_documents(self.index(unit))
        docs = [int(d) for row in rows for d in row]
        lengths = [int(self.dataset.documents.lengths[d]) for d in docs]
        return f"its documents are {self.split} documents {docs} (lengths {lengths})"


def expected_feature_bytes(
    rows: Mapping[str, Tensor], request: FeatureRequest, hidden_size: int, dtype: torch.dtype
) -> int:
    """The bytes of the features a worker returns for ``rows`` (the layout of ``FrozenTarget.features``)."""
    batch, width = rows["input_ids"].shape
    itemsize = torch.empty(0, dtype=dtype).element_size()
    per_token = len(request.layer_ids) * hidden_size * itemsize
    if request.final_positions != "none":
        per_token += hidden_size * itemsize + 1
    return int(batch * width * per_token + 8 * len(request.layer_ids))
