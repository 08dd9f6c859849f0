"""RemoteFeatures: every batch's target features from the run's target workers, then from their cache.

A draft module holds one and calls it from its hooks. Before Lightning moves a batch to the device
(``on_before_batch_transfer``, where its rows are still on the CPU the workers read them from), the feed
asks the workers for that micro-batch, sends the next ones ahead of need (:class:`PlannedUnits` knows
them from the loaders' plans), and adds the features to the batch, which then travels to the device with
them. With ``cache_dir`` it keeps what arrives (:class:`FeatureCache`), asks for the documents no unit held
once the first epoch has run through, and switches the data module to the completed directory: later
epochs, and later runs of the config, train without workers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, Protocol

import torch
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor

from lightning_drafts.core.target_features import FeatureRequest
from lightning_drafts.datamodules.packing import collate_placed, place, plan_epoch
from lightning_drafts.training.features_manifest import SHARD_BYTES, CaptureIdentity
from lightning_drafts.training.remote.config import RemoteTargetConfig
from lightning_drafts.training.remote.feature_cache import FeatureCache
from lightning_drafts.training.remote.planned_units import PlannedUnits, expected_feature_bytes
from lightning_drafts.training.remote.remote_target import RemoteTarget
from lightning_drafts.training.remote.unit_ledger import Unit
from lightning_drafts.training.target import FrozenTarget


class FeatureReader(Protocol):
    """What the feed reads of the draft it serves (a ``DraftModule``)."""

    target: FrozenTarget

    def feature_request(self) -> FeatureRequest: ...

    def capture_identity(self) -> CaptureIdentity: ...

    def check_features_of(self, datamodule: Any) -> None: ...


class RemoteFeatures:
    """The target features of ``draft``'s batches, computed by target workers as ``config`` says.

    Args:
        config: the ``remote`` options.
        target_args: how a worker builds the target (``target``: hub id / path / config dict,
            ``attn_backend``, ``dtype``, ``seed``): the trainer's own target settings.
        draft: the module the features are for.
    """

    def __init__(
        self, config: RemoteTargetConfig, target_args: Mapping[str, Any], draft: FeatureReader
    ) -> None:
        self.config = config
        self.target_args = dict(target_args)
        self.draft = draft
        self.remote: RemoteTarget | None = None
        self.cache: FeatureCache | None = None
        # The run trains from its completed cache: no workers are started again.
        self.from_cache = False
        self._feeds: dict[str, PlannedUnits] = {}
        self._filling: dict[Unit, str] = {}
        self._validation_runs = 0

    # --- the workers ---------------------------------------------------------------------------------

    def identity(self) -> dict[str, Any]:
        """What a target worker must report to serve this draft (see ``RemoteTarget.start``)."""
        request = self.draft.feature_request()
        return {
            **self.draft.target.identity(),
            "layer_ids": list(request.layer_ids),
            "final_positions": request.final_positions,
            "attn_backend": self.target_args["attn_backend"],
            "torch": torch.__version__,
        }

    def build(self, **options: Any) -> RemoteTarget:
        """A :class:`RemoteTarget` of the draft's target and the config (``options`` override its keyword
        arguments, e.g. ``unit_timeout_s`` or ``worker_class``; ``worker_args`` the workers')."""
        request = self.draft.feature_request()
        worker_args = {
            **self.target_args,
            "layer_ids": request.layer_ids,
            "final_positions": request.final_positions,
            "threads": torch.get_num_threads(),
            **options.pop("worker_args", {}),
        }
        config = self.config
        settings = {
            "workers": max(config.workers, 1),
            "address": config.address,
            "prefetch": config.prefetch,
            "max_bytes_in_flight": int(config.max_mb_in_flight * 2**20),
            "worker_gpus": config.worker_gpus,
            "unit_timeout_s": config.unit_timeout_s,
            "describe": self._describe_unit,
            **options,
        }
        return RemoteTarget(worker_args, **settings)

    def use(self, remote: RemoteTarget) -> None:
        """Start ``remote`` (checking its workers against the draft's target) and take every batch's target
        features from it. ``remote.workers`` does this at fit or validation start."""
        remote.start(self.identity())
        self.remote = remote
        self._feeds, self._filling, self._validation_runs = {}, {}, 0
        rank_zero_info(remote.where())

    def start(self, trainer: Any) -> None:
        """At fit or validation start: start the configured workers, or train from a completed cache."""
        if not self.config.workers or self.remote is not None or self.from_cache:
            return
        if self.config.cache_dir is not None:
            datamodule = getattr(trainer, "datamodule", None)
            if datamodule is None or not hasattr(datamodule, "use_features"):
                raise ValueError(
                    "remote.cache_dir needs the run's PackedChatDataModule (trainer.fit(model, datamodule=...))"
                )
            if trainer.world_size > 1:
                raise ValueError(
                    f"remote.cache_dir caches one trainer rank's units, but this run has {trainer.world_size} "
                    "ranks; cache with one rank, or capture with `lightning-drafts capture` (torchrun-parallel)"
                )
            self.cache = FeatureCache(
                self.config.cache_dir,
                self.draft.capture_identity(),
                datamodule.captured_sources(),
                datamodule.capture_record(),
                self.config.cache_dtype,
                SHARD_BYTES,
            )
            if self.cache.complete:
                self._train_from_cache(trainer)
                return
        self.use(self.build())

    def close(self) -> None:
        if self.remote is not None:
            self.remote.close()
            self.remote = None

    def _describe_unit(self, unit: Unit) -> str:
        feed = self._feeds.get(unit.split)
        return feed.describe(unit) if feed is not None else self._filling.get(unit, str(unit))

    # --- each batch ------------------------------------------------------------------------------------

    def add_features(self, batch: Any, trainer: Any, dataloader_idx: int = 0) -> Any:
        """``batch`` (its rows, still on the CPU) with the target features the workers computed for it;
        unchanged without workers, or when it carries features already (from a features directory)."""
        if self.remote is None or not isinstance(batch, Mapping) or "target_hidden_states" in batch:
            return batch
        return {**batch, **self._features(batch, trainer, dataloader_idx)}

    def _features(self, batch: Mapping[str, Tensor], trainer: Any, dataloader_idx: int) -> dict[str, Tensor]:
        split = "train" if trainer.training else "val"
        feed = self._feeds.get(split)
        if feed is None:
            feed = self._feeds[split] = self._plan(split, trainer, dataloader_idx)
        unit = feed.unit(feed.advance())
        upcoming = [(feed.unit(i), partial(feed.rows, i)) for i in feed.upcoming(self.remote.prefetch)]
        features = self._exchange(unit, batch, upcoming)
        if self.cache is not None:
            source = trainer.datamodule.source_of(split)
            documents, placement = feed.dataset.documents, feed.dataset.placement(feed.index(unit))
            self.cache.receive(source, documents, placement, features)
        return features

    def _exchange(
        self,
        unit: Unit,
        rows: Mapping[str, Tensor],
        upcoming: list[tuple[Unit, Callable[[], Mapping[str, Tensor]]]],
    ) -> dict[str, Tensor]:
        """``unit``'s features (its token ``rows``): it goes out first, then the ``upcoming`` units (each with
        a function building its rows, called only for a unit not sent yet) as the cap allows."""
        remote = self.remote
        request, hidden, dtype = self._sizes()
        needed = expected_feature_bytes(rows, request, hidden, dtype)
        remote.offer(unit, rows, needed, force=True)
        for ahead, rows_of in upcoming:
            if remote.ledger.known(ahead):
                continue
            more = rows_of()
            if not remote.offer(ahead, more, expected_feature_bytes(more, request, hidden, dtype)):
                break
        return remote.take(unit, rows, needed)

    def _plan(self, split: str, trainer: Any, dataloader_idx: int) -> PlannedUnits:
        loader = trainer.train_dataloader if split == "train" else trainer.val_dataloaders
        if isinstance(loader, (list, tuple)):
            loader = loader[dataloader_idx]
        if split == "train":
            epoch, accumulate, limit = loader.dataset.epoch, trainer.accumulate_grad_batches, None
        else:
            epoch, accumulate = self._validation_runs, 1
            counts = trainer.num_sanity_val_batches if trainer.sanity_checking else trainer.num_val_batches
            limit = counts[dataloader_idx] if dataloader_idx < len(counts) else None
        return PlannedUnits(split, loader.dataset, epoch, trainer.global_rank, accumulate, limit)

    def _sizes(self) -> tuple[FeatureRequest, int, torch.dtype]:
        target = self.draft.target
        return self.draft.feature_request(), int(target.text_config.hidden_size), target.compute_dtype

    # --- epochs ----------------------------------------------------------------------------------------

    def on_train_epoch_start(self) -> None:
        if self.remote is not None:
            self._feeds.pop("train", None)

    def on_train_epoch_end(self, trainer: Any) -> None:
        feed = self._feeds.get("train") if self.remote is not None else None
        # An epoch cut short (max_steps) leaves the cache to the run that trains the rest of it.
        if self.cache is None or feed is None or feed.cursor < feed.end:
            return
        self._fill_cache(trainer)
        self.cache.finish()
        self._train_from_cache(trainer)

    def on_validation_epoch_start(self) -> None:
        if self.remote is not None:
            self._feeds.pop("val", None)
            self._validation_runs += 1

    def on_validation_epoch_end(self) -> None:
        # Units a validation run sent ahead but did not reach (a shorter limit than planned) are let go.
        if self.remote is not None:
            self.remote.forget("val")

    # --- online, then cached ---------------------------------------------------------------------------

    def _fill_cache(self, trainer: Any) -> None:
        """Ask the workers for the documents no training or validation unit held, packed as a capture
        packs them, and keep their features."""
        datamodule = trainer.datamodule
        for number, (source, documents) in enumerate(self.cache.missing().items()):
            plan = plan_epoch(
                documents.lengths,
                mode="microbatch",
                max_tokens=datamodule.max_tokens,
                batch_size=datamodule.batch_size,
                seed=0,
                epoch=0,
                shuffle=False,
            )
            units = [Unit("cache", number, i, trainer.global_rank, 0) for i in range(len(plan))]
            placements = [place(documents, plan, i) for i in range(len(plan))]
            rows = [collate_placed(documents, p, datamodule.pad_token_id) for p in placements]
            for unit, placement in zip(units, placements, strict=True):
                offsets = [int(documents.starts[d]) for d in placement.docs]
                self._filling[unit] = f"its documents are {source} documents at corpus offsets {offsets}"
            for i, unit in enumerate(units):
                ahead = range(i + 1, min(i + 1 + self.remote.prefetch, len(units)))
                features = self._exchange(
                    unit, rows[i], [(units[j], partial(rows.__getitem__, j)) for j in ahead]
                )
                self.cache.receive(source, documents, placements[i], features)

    def _train_from_cache(self, trainer: Any) -> None:
        """Every batch from now on carries its features from the completed cache; the workers go."""
        manifest = trainer.datamodule.use_features(str(self.cache.directory))
        self.draft.check_features_of(trainer.datamodule)
        self.close()
        self.cache, self.from_cache = None, True
        rank_zero_info(f"target: training from the features cached in {manifest['directory']} (no workers)")
