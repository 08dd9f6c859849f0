"""The train loader: an epoch's planned micro-batches, per rank, resumable mid-epoch.

Design, kept deliberately small:

* :class:`PackedEpochDataset` is a map-style dataset whose item ``i`` is micro-batch ``i`` of one epoch's
  :func:`~lightning_drafts.datamodules.packing.plan_epoch` for its rank; :class:`PlanOrder` hands out
  the indices from ``skip`` on, in order. Rank sharding is part of the plan, so the sampler is a
  ``DistributedSampler``: Lightning leaves a loader that already has one alone instead of wrapping it in
  its own. (An ``IterableDataset`` would avoid the sampler, but Lightning warns about any iterable with a
  length, and the length is what progress bars and epoch-based schedules need.) Workers fetch the
  indices the main process hands them, so the order is the same for any worker count.
* :class:`ResumableLoader` is the ``DataLoader`` around it. Its ``__iter__`` runs in the main process, so
  it decides the epoch and the resume offset there (before workers receive the dataset) and counts the
  micro-batches it hands out.
* :class:`LoaderState` is the state both the DataModule and the loader expose through ``state_dict``.
  Under a Trainer the position is the Trainer's own count of processed training batches, which is
  exact at checkpoint time (the loader's count runs ahead by Lightning's prefetch); without a Trainer
  the loader's count is used and each ``iter()`` starts the next epoch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_drafts.datamodules.documents import Documents
from lightning_drafts.datamodules.feature_store import SourceFeatures
from lightning_drafts.datamodules.packing import MicroBatchPlan, collate_placed, place, plan_epoch


class PackedEpochDataset(Dataset):
    """Micro-batches of one epoch for one rank; set ``epoch`` (and ``skip``, read by :class:`PlanOrder`)
    before iterating. With ``features``, each micro-batch also carries its documents' captured target
    features, laid out as its tokens are."""

    def __init__(
        self,
        documents: Documents,
        *,
        mode: str,
        max_tokens: int,
        batch_size: int,
        pad_token_id: int,
        seed: int,
        shuffle: bool,
        shuffle_buffer: int,
        world_size: int,
        rank: int,
        features: SourceFeatures | None = None,
    ) -> None:
        self.documents = documents
        self.features = features
        self.pad_token_id = pad_token_id
        self.plan_kwargs = dict(
            mode=mode,
            max_tokens=max_tokens,
            batch_size=batch_size,
            seed=seed,
            shuffle=shuffle,
            shuffle_buffer=shuffle_buffer,
            world_size=world_size,
            rank=rank,
        )
        self.epoch = 0
        self.skip = 0
        self._plan: tuple[int, MicroBatchPlan] | None = None

    def plan(self, epoch: int) -> MicroBatchPlan:
        if self._plan is None or self._plan[0] != epoch:
            self._plan = (epoch, plan_epoch(self.documents.lengths, epoch=epoch, **self.plan_kwargs))
        return self._plan[1]

    def identity(self) -> dict[str, Any]:
        """What a saved position is only meaningful for: the plan's inputs except the epoch and the rank
        (Lightning saves rank 0's state and every rank resumes from it)."""
        identity = {key: value for key, value in self.plan_kwargs.items() if key != "rank"}
        return {**identity, "documents": len(self.documents), "tokens": self.documents.num_tokens}

    def __len__(self) -> int:
        return len(self.plan(self.epoch))

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        placement = place(self.documents, self.plan(self.epoch), index)
        batch = collate_placed(self.documents, placement, self.pad_token_id)
        if self.features is not None:
            batch.update(self.features.gather(self.documents, placement))
        return batch


class PlanOrder(DistributedSampler):
    """The dataset's micro-batches in plan order, from its ``skip`` on (the plan is this rank's already)."""

    def __init__(self, dataset: PackedEpochDataset) -> None:
        rank, world_size = dataset.plan_kwargs["rank"], dataset.plan_kwargs["world_size"]
        super().__init__(dataset, num_replicas=world_size, rank=rank, shuffle=False)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.dataset.skip, len(self.dataset)))

    def __len__(self) -> int:
        return len(self.dataset)

    def set_epoch(self, epoch: int) -> None:
        """Ignored: the loader's state decides the epoch (it also knows a resumed one)."""


class LoaderState:
    """Epoch and position (micro-batches consumed) of the train loader, plus a pending resume point."""

    def __init__(self, trainer: Callable[[], Any]) -> None:
        self._trainer = trainer
        self.epoch = 0
        self.position = 0
        self.identity: dict[str, Any] | None = None
        self._next_epoch = 0
        self._pending: dict[str, Any] | None = None

    def begin(self, identity: dict[str, Any]) -> tuple[int, int]:
        """Start an iteration: return ``(epoch, micro-batches to skip)``."""
        trainer = self._fitting_trainer()
        pending, self._pending = self._pending, None
        if trainer is not None:
            epoch = int(trainer.current_epoch)
        elif pending is not None:
            epoch = int(pending["epoch"])
        else:
            epoch = self._next_epoch
        skip = 0
        if pending is not None and int(pending["epoch"]) == epoch and int(pending["position"]) > 0:
            if pending.get("identity") != identity:
                raise ValueError(
                    f"cannot resume the train loader mid-epoch {epoch} at micro-batch {pending['position']}: the "
                    f"checkpoint's packing setup {pending.get('identity')} differs from the current {identity}; "
                    "resume with the same data, packing, batch_size, max_tokens, seed and world size, or from an "
                    "end-of-epoch checkpoint"
                )
            skip = int(pending["position"])
        self.epoch, self.position, self.identity, self._next_epoch = epoch, skip, identity, epoch + 1
        return epoch, skip

    def state_dict(self) -> dict[str, Any]:
        epoch, position = self.epoch, self.position
        trainer = self._fitting_trainer()
        if trainer is not None:
            # The epoch the batch counter belongs to is the last one started: after a max_steps stop,
            # Lightning already counts that epoch as completed (current_epoch moved on) while the counter
            # still holds its batches.
            loop = trainer.fit_loop
            epoch = max(int(loop.epoch_progress.current.started) - 1, 0)
            position = int(loop.epoch_loop.batch_progress.current.processed)
        return {"epoch": epoch, "position": position, "identity": self.identity}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = {"epoch", "position"} - set(state)
        if missing:
            raise ValueError(f"loader state {state} lacks {sorted(missing)}; pass a state from state_dict()")
        self._pending = dict(state)
        self.epoch, self.position, self.identity = (
            int(state["epoch"]),
            int(state["position"]),
            state.get("identity"),
        )

    def _fitting_trainer(self) -> Any:
        trainer = self._trainer()
        if trainer is None or not getattr(trainer.state, "fn", None) == "fit":
            return None
        return trainer


class ResumableLoader(DataLoader):
    """A ``DataLoader`` over :class:`PackedEpochDataset` that picks the epoch and resume point per iteration.

    Workers are not persistent: each epoch's ``iter()`` hands them the dataset with the new epoch set.
    """

    def __init__(self, dataset: PackedEpochDataset, state: LoaderState, num_workers: int = 0) -> None:
        # So that len() (Lightning reads it before the first iteration) describes the epoch about to run.
        dataset.epoch = state.epoch
        super().__init__(
            dataset,
            batch_size=None,
            sampler=PlanOrder(dataset),
            num_workers=num_workers,
            pin_memory=torch.cuda.is_available(),
        )
        self.state = state

    def __iter__(self) -> Iterator[dict[str, Tensor]]:
        dataset: PackedEpochDataset = self.dataset
        dataset.epoch, dataset.skip = self.state.begin(dataset.identity())
        return self._count(super().__iter__())

    def _count(self, batches: Iterator[dict[str, Tensor]]) -> Iterator[dict[str, Tensor]]:
        for batch in batches:
            self.state.position += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return self.state.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state.load_state_dict(state)
