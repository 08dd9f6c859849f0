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
  the loader's count is used and each ``iter()`` starts the next epoch. Beside the position it records
  ``consumed``: the epoch's units (rows or documents) all ranks together have used, which means the same
  on any world size. A resumed epoch deals only the units after those (``plan_epoch(start=...)``), so a
  checkpoint of 2 ranks resumes on 1 or 4 with every document of the epoch still used exactly once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_drafts.datamodules.documents import Documents
from lightning_drafts.datamodules.feature_store import SourceFeatures
from lightning_drafts.datamodules.packing import MicroBatchPlan, Placement, collate_placed, place, plan_epoch


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
        # A resumed epoch: the units already consumed (dealt no more) and the micro-batches already run on
        # this rank (the indices below `skip` are those, so Lightning's batch count carries on).
        self.start = 0
        self.skip = 0
        self._plan: tuple[tuple[int, int], MicroBatchPlan] | None = None

    def plan(self, epoch: int, start: int = 0) -> MicroBatchPlan:
        if self._plan is None or self._plan[0] != (epoch, start):
            plan = plan_epoch(self.documents.lengths, epoch=epoch, start=start, **self.plan_kwargs)
            self._plan = ((epoch, start), plan)
        return self._plan[1]

    def identity(self) -> dict[str, Any]:
        """What a saved position is only meaningful for: the plan's inputs except the epoch, the rank and
        the world size (the consumed units mean the same on any)."""
        identity = {k: v for k, v in self.plan_kwargs.items() if k not in ("rank", "world_size")}
        return {**identity, "documents": len(self.documents), "tokens": self.documents.num_tokens}

    def consumed_after(self, position: int) -> int:
        """Units of the current epoch consumed by all ranks once this rank has run ``position`` micro-batches."""
        units_after = self.plan(self.epoch, self.start).units_after
        return int(units_after[min(max(position - self.skip, 0), len(units_after) - 1)])

    def __len__(self) -> int:
        return self.skip + len(self.plan(self.epoch, self.start))

    def placement(self, index: int) -> Placement:
        """Where micro-batch ``index`` puts its documents' tokens."""
        return place(self.documents, self.plan(self.epoch, self.start), index - self.skip)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        placement = self.placement(index)
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
        # The dataset being iterated (None before the first epoch), which knows the units consumed so far.
        # Kept as the object, not a lambda, so that the data module still pickles (ddp_spawn, Ray).
        self._dataset: PackedEpochDataset | None = None

    def begin(self, dataset: PackedEpochDataset) -> None:
        """Start an iteration over ``dataset``: set its epoch, and for a resumed epoch the units already
        consumed and the micro-batches already run."""
        pending, self._pending = self._pending, None
        epoch, skip = self.prepare(dataset, pending)
        self.epoch, self.position, self.identity, self._next_epoch = (
            epoch,
            skip,
            dataset.identity(),
            epoch + 1,
        )
        self._dataset = dataset

    def prepare(self, dataset: PackedEpochDataset, pending: dict[str, Any] | None = None) -> tuple[int, int]:
        """Set ``dataset`` to the epoch the next iteration runs (so that its length is that epoch's before
        the iteration starts) and return ``(epoch, micro-batches already run)``; changes no state."""
        epoch, skip, consumed = self._resume_point(dataset, self._pending if pending is None else pending)
        if consumed is None:
            # A position saved before consumed units were recorded: meaningful at its own world size only.
            dataset.start, dataset.skip = 0, 0
            consumed = dataset.plan(epoch).units_after[skip] if skip else 0
        dataset.epoch, dataset.start, dataset.skip = epoch, int(consumed), skip
        return epoch, skip

    def _resume_point(
        self, dataset: PackedEpochDataset, pending: dict[str, Any] | None
    ) -> tuple[int, int, int | None]:
        """``(epoch, micro-batches already run, units already consumed or None if not recorded)``."""
        identity, world_size = dataset.identity(), dataset.plan_kwargs["world_size"]
        trainer = self._fitting_trainer()
        if trainer is not None:
            epoch = int(trainer.current_epoch)
        elif pending is not None:
            epoch = int(pending["epoch"])
        else:
            epoch = self._next_epoch
        skip, consumed = 0, 0
        if pending is not None and int(pending["epoch"]) == epoch and int(pending["position"]) > 0:
            saved = dict(pending.get("identity") or {})
            saved_world_size = saved.pop("world_size", None)
            if saved != identity:
                raise ValueError(
                    f"cannot resume the train loader mid-epoch {epoch} at micro-batch {pending['position']}: the "
                    f"checkpoint's packing setup {saved} differs from the current {identity}; resume with the "
                    "same data, packing, batch_size, max_tokens and seed, or from an end-of-epoch checkpoint"
                )
            skip = int(pending["position"])
            consumed = pending.get("consumed")
            if consumed is None and saved_world_size not in (None, world_size):
                raise ValueError(
                    f"cannot resume the train loader mid-epoch {epoch} on {world_size} ranks: the checkpoint was "
                    f"written on {saved_world_size} by a release that did not record the documents consumed; "
                    f"resume on {saved_world_size} ranks, or from an end-of-epoch checkpoint"
                )
            plan = dataset.plan(epoch)
            if skip >= len(plan) if consumed is None else int(consumed) >= int(plan.units_after[-1]):
                # Saved after the epoch's last micro-batch (an end-of-epoch checkpoint): Lightning resumes into
                # the next epoch, and draws that epoch's batches from the iterator it made before it moved its
                # epoch counter on, so the next epoch must start here and not from the finished one.
                return epoch + 1, 0, 0
        return epoch, skip, consumed

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
        consumed = (
            self._dataset.consumed_after(position) if self._dataset is not None and epoch == self.epoch else 0
        )
        return {"epoch": epoch, "position": position, "consumed": consumed, "identity": self.identity}

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
        # So that len() (Lightning reads it before the first iteration) describes the epoch about to run,
        # a resumed one included.
        state.prepare(dataset)
        super().__init__(
            dataset,
            batch_size=None,
            sampler=PlanOrder(dataset),
            num_workers=num_workers,
            pin_memory=torch.cuda.is_available(),
        )
        self.state = state

    def __iter__(self) -> Iterator[dict[str, Tensor]]:
        self.state.begin(self.dataset)
        return self._count(super().__iter__())

    def _count(self, batches: Iterator[dict[str, Tensor]]) -> Iterator[dict[str, Tensor]]:
        for batch in batches:
            self.state.position += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return self.state.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state.load_state_dict(state)
