"""DraftModule: the LightningModule every draft family builds on.

It owns the frozen target, validates batches, runs the draft's objective (``compute_loss``), logs it,
builds the optimiser, and keeps the target out of checkpoints. A family subclass adds its draft
``nn.Module`` and ``compute_loss``; nothing family-specific lives here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from transformers import PreTrainedModel

from lightning_drafts.attention.backends import compiled_variants
from lightning_drafts.callbacks.acceptance import AcceptanceCallback
from lightning_drafts.core.batch import PackedBatch, validate_batch
from lightning_drafts.core.checks import check_number
from lightning_drafts.core.draft_output import DraftOutput
from lightning_drafts.core.ratio_metric import RatioSum, ratio_metrics
from lightning_drafts.core.schedule import warmup_cosine
from lightning_drafts.core.target_features import FeatureRequest
from lightning_drafts.datamodules.packing import collate_placed, place, plan_epoch
from lightning_drafts.training.checkpoint_integrity import check_digests, check_family, record_digests
from lightning_drafts.training.feature_cache import FeatureCache
from lightning_drafts.training.features_manifest import SHARD_BYTES, storage_dtype
from lightning_drafts.training.planned_units import PlannedUnits, expected_feature_bytes
from lightning_drafts.training.remote_target import RemoteTarget
from lightning_drafts.training.row_positions import check_row_positions
from lightning_drafts.training.step_draws import micro_batch_generator
from lightning_drafts.training.target import FrozenTarget, TargetOutput, TargetSpec, as_dtype
from lightning_drafts.training.unit_ledger import Unit

TARGET_PREFIX = "target."


class DraftModule(L.LightningModule):
    """Shared base of the draft LightningModules.

    Args:
        target: hub id / local path, config dict (random tiny target, seeded by ``target_seed``), or a
            ``transformers.PreTrainedModel``.
        target_attn_backend: ``"auto"``, ``"sdpa"``, ``"eager"``, ``"flex"`` or ``"flash"`` (see
            :mod:`lightning_drafts.attention.backends`).
        target_dtype: the target's parameter dtype (``None`` keeps the checkpoint's).
        learning_rate, betas, weight_decay: AdamW over the draft's trainable parameters.
        warmup_ratio, min_lr_ratio: the warmup-cosine schedule over the run's optimizer steps.
        shard_target: under ``ModelParallelStrategy`` (FSDP2), shard the target per decoder layer
            instead of replicating it on every rank (for targets that do not fit one device).
        activation_checkpointing: recompute each draft decoder layer's activations in backward (any
            strategy; not EAGLE-3, whose one layer appends to the TTT cache as it runs).
        target_decoder: keep the target's decoder layers. ``False``: a checkpoint target is loaded without
            them (their weights are never read; a config-dict target is built whole and freed): for
            training from a features directory only, where the target's embedding, final norm and LM head
            are all a draft reads; a batch without features is refused.
        target_workers: run the target on this many Ray workers instead of in the trainer's process (a
            local Ray is started for the run unless ``target_address`` names a cluster): every batch then
            carries the target features a worker computed for its exact rows, and the trainer keeps only
            the target's embedding, final norm and LM head (see docs/guides/disaggregated.md).
        target_address: the Ray cluster's address for ``target_workers`` (``ray start --head`` prints it).
        target_prefetch: micro-batches sent to the workers ahead of the one being trained on.
        target_max_mb_in_flight: cap on the feature bytes (MiB) sent for or waiting to be trained on.
        target_worker_gpus: GPUs per worker (0 on CPU machines).
        target_unit_timeout_s: send a unit again, to another worker, when its features are this many seconds
            late (``None``: only when its worker died); a late first result that still arrives is dropped.
        target_cache_dir: online, then cached: write the features the workers send into this features
            directory (the layout and manifest of ``lightning-drafts capture``) and, once the first epoch has
            run through, train every later epoch from it without the workers (a later run of the same config
            finds it complete and starts none). One trainer rank only.
        target_cache_dtype: its storage dtype (``bfloat16``, ``float16``, ``float32`` or ``float8_e4m3fn``).
        tokenizer_vocab_size, pad_token_id: linked from the data module by the CLI. A config-dict
            target without ``vocab_size`` takes the tokenizer's; a larger tokenizer than the target's
            vocabulary is refused.
    """

    def __init__(
        self,
        target: TargetSpec,
        target_attn_backend: str = "auto",
        target_dtype: str | None = None,
        target_seed: int = 0,
        learning_rate: float = 1e-4,
        betas: tuple[float, float] = (0.9, 0.95),
        weight_decay: float = 0.0,
        warmup_ratio: float = 0.05,
        min_lr_ratio: float = 0.1,
        shard_target: bool = False,
        activation_checkpointing: bool = False,
        target_decoder: bool = True,
        target_workers: int = 0,
        target_address: str | None = None,
        target_prefetch: int = 4,
        target_max_mb_in_flight: float = 256.0,
        target_worker_gpus: float = 0.0,
        target_unit_timeout_s: float | None = None,
        target_cache_dir: str | None = None,
        target_cache_dtype: str = "bfloat16",
        tokenizer_vocab_size: int | None = None,
        pad_token_id: int | None = None,
    ) -> None:
        super().__init__()
        check_number("learning_rate", learning_rate, minimum=0, above_minimum=True)
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"betas = {betas!r}; it must be two numbers (beta1, beta2) in [0, 1)")
        for index, beta in enumerate(betas):
            check_number(f"betas[{index}]", beta, minimum=0, maximum=1, below_maximum=True)
        check_number("weight_decay", weight_decay, minimum=0)
        check_number("warmup_ratio", warmup_ratio, minimum=0, maximum=1)
        check_number("min_lr_ratio", min_lr_ratio, minimum=0, maximum=1)
        self.save_hyperparameters(ignore=["target"] if isinstance(target, PreTrainedModel) else None)
        target = _with_tokenizer_vocab(target, tokenizer_vocab_size)
        if target_workers < 0:
            raise ValueError(f"target_workers = {target_workers}; it must be >= 0 (0 runs the target here)")
        if target_workers and not isinstance(target, (str, dict)):
            raise ValueError(
                "target_workers needs a target the workers can build themselves: a hub id / path or a config "
                f"dict, not a {type(target).__name__} instance"
            )
        if target_address is not None and not target_workers:
            raise ValueError(
                f"target_address = {target_address!r} names the Ray cluster of the target workers, but "
                f"target_workers = {target_workers}, so the target runs here and the address would be ignored; "
                "set target_workers (e.g. 1), or drop target_address"
            )
        if target_cache_dir is not None and not target_workers:
            raise ValueError(
                f"target_cache_dir = {target_cache_dir!r} caches what target workers send, but target_workers = "
                f"{target_workers}; set target_workers, or capture with `lightning-drafts capture`"
            )
        if target_unit_timeout_s is not None:
            check_number("target_unit_timeout_s", target_unit_timeout_s, minimum=0, above_minimum=True)
        storage_dtype(target_cache_dtype)
        self._cache: FeatureCache | None = None
        # The run trains from its completed cache: no workers are started again.
        self._from_cache = False
        # What a target worker builds: the trainer's own target (an instance is not kept twice: as an
        # attribute of a module it would become a submodule, and its weights checkpoint keys).
        self.target_spec = target if isinstance(target, (str, dict)) else None
        self.remote_target: RemoteTarget | None = None
        self.target = FrozenTarget(
            target,
            attn_backend=target_attn_backend,
            dtype=target_dtype,
            seed=target_seed,
            # The workers run the decoder; the trainer reads only the embedding, final norm and LM head.
            decoder=target_decoder and not target_workers,
        )
        if tokenizer_vocab_size is not None and tokenizer_vocab_size > self.target.vocab_size:
            raise ValueError(
                f"the tokenizer has {tokenizer_vocab_size} tokens but the target's vocabulary has "
                f"{self.target.vocab_size}; the tokenizer does not belong to this target"
            )
        self.loss_sums = ratio_metrics(["loss"])
        # Checkpoints hold only the draft. Strategies that load state themselves (FSDP2) must not
        # demand target keys; on_load_checkpoint still refuses a checkpoint missing draft keys.
        self.strict_loading = False

    # --- the objective -------------------------------------------------------------------------

    def compute_loss(self, batch: Mapping[str, Tensor], anchors: Tensor | None = None) -> DraftOutput:
        """The draft's objective on one micro-batch (implemented by each family)."""
        raise NotImplementedError(f"{type(self).__name__} must implement compute_loss")

    def prepare_batch(self, batch: Mapping[str, Tensor] | PackedBatch) -> PackedBatch:
        """Validate ``batch`` against the contract and the target's vocabulary."""
        if isinstance(batch, PackedBatch):
            return batch
        return validate_batch(batch, vocab_size=self.target.vocab_size)

    # --- the target's signal: live, or captured -----------------------------------------------

    def feature_request(self) -> FeatureRequest:
        """The target features this draft reads (implemented by each family that trains from captures)."""
        raise NotImplementedError(
            f"{type(self).__name__} does not declare the target features it reads (feature_request), so it "
            "cannot be captured for or trained from a features directory"
        )

    def target_output(
        self, packed: PackedBatch, layer_ids: Sequence[int], final: bool = True
    ) -> TargetOutput:
        """The target's outputs of ``layer_ids`` and its final-norm states for ``packed``: from the
        batch's captured features when it has them (no target forward), else one live forward
        (``final=False``: a draft that reads no final state, whose forward stops at its deepest layer)."""
        if packed.target_features is None:
            return self.target(packed, layer_ids, final=final)
        return TargetOutput.from_features(packed.target_features, layer_ids, self.target.compute_dtype)

    @torch.no_grad()
    def features_for(self, batch: Mapping[str, Tensor] | PackedBatch) -> dict[str, Tensor]:
        """The feature keys of :mod:`lightning_drafts.core.target_features` for ``batch``'s rows, from one
        live forward (:meth:`FrozenTarget.features` of what :meth:`feature_request` names)."""
        return self.target.features(self.prepare_batch(batch), self.feature_request())

    def check_features(self, manifest: Mapping[str, Any]) -> None:
        """Refuse a features directory (its ``manifest``) that was not captured for this draft, naming the
        first field that differs: the target, its dtype or sizes, the layers, the final-state positions."""
        recorded = manifest.get("target", {})
        where = manifest.get("directory", "the features directory")
        for field, value in self.target.identity().items():
            if recorded.get(field) != value:
                raise ValueError(
                    f"{where} was captured from another target: target.{field} is {recorded.get(field)!r} there "
                    f"but {value!r} here; capture again for this target (or train with the target it names: "
                    f"{recorded.get('spec')!r})"
                )
        problem = self.feature_request().served_by(
            tuple(manifest.get("layer_ids", ())), manifest.get("final_positions", "none")
        )
        if problem is not None:
            raise ValueError(
                f"{where} does not hold what this draft reads: {problem}; capture again with this config"
            )

    # --- the target on its own workers ----------------------------------------------------------

    def remote_identity(self) -> dict[str, Any]:
        """What a target worker must report to serve this draft (see ``RemoteTarget.start``)."""
        request = self.feature_request()
        return {
            **self.target.identity(),
            "layer_ids": list(request.layer_ids),
            "final_positions": request.final_positions,
            "attn_backend": self.hparams.get("target_attn_backend", "auto"),
            "torch": torch.__version__,
        }

    def _start_remote_target(self) -> None:
        if not self.hparams.get("target_workers") or self.remote_target is not None or self._from_cache:
            return
        cache_dir = self.hparams.get("target_cache_dir")
        if cache_dir is not None:
            datamodule = getattr(self.trainer, "datamodule", None)
            if datamodule is None or not hasattr(datamodule, "use_features"):
                raise ValueError(
                    "target_cache_dir needs the run's PackedChatDataModule (trainer.fit(model, datamodule=...))"
                )
            if self.trainer.world_size > 1:
                raise ValueError(
                    f"target_cache_dir caches one trainer rank's units, but this run has {self.trainer.world_size} "
                    "ranks; cache with one rank, or capture with `lightning-drafts capture` (torchrun-parallel)"
                )
            self._cache = FeatureCache(
                cache_dir,
                self,
                datamodule.captured_sources(),
                datamodule.capture_record(),
                self.hparams.get("target_cache_dtype", "bfloat16"),
                SHARD_BYTES,
            )
            if self._cache.complete:
                self._train_from_cache()
                return
        self.use_remote_target(self.build_remote_target())

    def build_remote_target(self, **options: Any) -> RemoteTarget:
        """A :class:`RemoteTarget` of this draft's target and the ``target_*`` options (``options``
        override its keyword arguments, e.g. ``unit_timeout_s`` or ``worker_class``)."""
        request = self.feature_request()
        hparams = self.hparams
        worker_args = {
            "target": self.target_spec,
            "attn_backend": hparams.get("target_attn_backend", "auto"),
            "dtype": hparams.get("target_dtype"),
            "seed": hparams.get("target_seed", 0),
            "layer_ids": request.layer_ids,
            "final_positions": request.final_positions,
            "threads": torch.get_num_threads(),
            **options.pop("worker_args", {}),
        }
        settings = {
            "workers": max(int(hparams.get("target_workers", 0)), 1),
            "address": hparams.get("target_address"),
            "prefetch": hparams.get("target_prefetch", 4),
            "max_bytes_in_flight": int(hparams.get("target_max_mb_in_flight", 256.0) * 2**20),
            "worker_gpus": hparams.get("target_worker_gpus", 0.0),
            "unit_timeout_s": hparams.get("target_unit_timeout_s"),
            "describe": self._describe_unit,
            **options,
        }
        return RemoteTarget(worker_args, **settings)

    def use_remote_target(self, remote: RemoteTarget) -> None:
        """Start ``remote`` (checking its workers against this draft's target) and take every batch's
        target features from it. ``target_workers`` does this at fit or validation start."""
        remote.start(self.remote_identity())
        self.remote_target = remote
        self._feeds: dict[str, PlannedUnits] = {}
        self._filling: dict[Unit, str] = {}
        self._validation_runs = 0
        rank_zero_info(remote.where())

    def _describe_unit(self, unit: Unit) -> str:
        feed = self._feeds.get(unit.split)
        return feed.describe(unit) if feed is not None else self._filling.get(unit, str(unit))

    def with_remote_features(self, batch: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
        """``batch`` with the target features its workers computed for it (unchanged without a remote
        target, or when it carries features already)."""
        if self.remote_target is None or "target_hidden_states" in batch:
            return batch
        device = batch["input_ids"].device
        features = self._remote_features({key: value.cpu() for key, value in batch.items()})
        return {**batch, **{key: value.to(device) for key, value in features.items()}}

    def _remote_features(self, batch: Mapping[str, Tensor], dataloader_idx: int = 0) -> dict[str, Tensor]:
        trainer, remote = self.trainer, self.remote_target
        split = "train" if trainer.training else "val"
        feed = self._feeds.get(split)
        if feed is None:
            loader = trainer.train_dataloader if split == "train" else trainer.val_dataloaders
            if isinstance(loader, (list, tuple)):
                loader = loader[dataloader_idx]
            if split == "train":
                epoch, accumulate, limit = loader.dataset.epoch, trainer.accumulate_grad_batches, None
            else:
                epoch, accumulate = self._validation_runs, 1
                counts = (
                    trainer.num_sanity_val_batches if trainer.sanity_checking else trainer.num_val_batches
                )
                limit = counts[dataloader_idx] if dataloader_idx < len(counts) else None
            feed = self._feeds[split] = PlannedUnits(
                split, loader.dataset, epoch, trainer.global_rank, accumulate, limit
            )
        request = self.feature_request()
        hidden, dtype = int(self.target.text_config.hidden_size), self.target.compute_dtype
        unit = feed.unit(feed.advance())
        needed = expected_feature_bytes(batch, request, hidden, dtype)
        # The unit needed now goes out first, then the ones after it as the cap allows.
        remote.offer(unit, batch, needed, force=True)
        for index in feed.upcoming(remote.prefetch):
            ahead = feed.unit(index)
            if remote.ledger.known(ahead):
                continue
            rows = feed.rows(index)
            if not remote.offer(ahead, rows, expected_feature_bytes(rows, request, hidden, dtype)):
                break
        features = remote.take(unit, batch, needed)
        if self._cache is not None:
            source = trainer.datamodule.source_of(split)
            documents, placement = feed.dataset.documents, feed.dataset.placement(feed.index(unit))
            self._cache.receive(source, documents, placement, features)
        return features

    # --- online, then cached ----------------------------------------------------------------------

    def on_train_epoch_end(self) -> None:
        feed = self._feeds.get("train") if self.remote_target is not None else None
        # An epoch cut short (max_steps) leaves the cache to the run that trains the rest of it.
        if self._cache is None or feed is None or feed.cursor < feed.end:
            return
        self._fill_cache()
        self._cache.finish()
        self._train_from_cache()

    def _fill_cache(self) -> None:
        """Ask the workers for the documents no training or validation unit held, packed as a capture
        packs them, and keep their features."""
        datamodule, remote = self.trainer.datamodule, self.remote_target
        request = self.feature_request()
        hidden, dtype = int(self.target.text_config.hidden_size), self.target.compute_dtype
        for number, (source, documents) in enumerate(self._cache.missing().items()):
            plan = plan_epoch(
                documents.lengths,
                mode="microbatch",
                max_tokens=datamodule.max_tokens,
                batch_size=datamodule.batch_size,
                seed=0,
                epoch=0,
                shuffle=False,
            )
            units = [Unit("cache", number, i, self.trainer.global_rank, 0) for i in range(len(plan))]
            placements = [place(documents, plan, i) for i in range(len(plan))]
            rows = [collate_placed(documents, p, datamodule.pad_token_id) for p in placements]
            for unit, placement in zip(units, placements, strict=True):
                offsets = [int(documents.starts[d]) for d in placement.docs]
                self._filling[unit] = f"its documents are {source} documents at corpus offsets {offsets}"
            for i, unit in enumerate(units):
                needed = expected_feature_bytes(rows[i], request, hidden, dtype)
                remote.offer(unit, rows[i], needed, force=True)
                for ahead in range(i + 1, min(i + 1 + remote.prefetch, len(units))):
                    more = expected_feature_bytes(rows[ahead], request, hidden, dtype)
                    if not remote.offer(units[ahead], rows[ahead], more):
                        break
                features = remote.take(unit, rows[i], needed)
                self._cache.receive(source, documents, placements[i], features)

    def _train_from_cache(self) -> None:
        """Every batch from now on carries its features from the completed cache; the workers go."""
        manifest = self.trainer.datamodule.use_features(str(self._cache.directory))
        self.check_features(manifest)
        self._features_checked = manifest.get("directory")
        if self.remote_target is not None:
            self.remote_target.close()
            self.remote_target = None
        self._cache, self._from_cache = None, True
        rank_zero_info(f"target: training from the features cached in {manifest['directory']} (no workers)")

    def on_train_epoch_start(self) -> None:
        if self.remote_target is not None:
            self._feeds.pop("train", None)

    def on_validation_epoch_start(self) -> None:
        if self.remote_target is not None:
            self._feeds.pop("val", None)
            self._validation_runs += 1

    def on_validation_epoch_end(self) -> None:
        # Units a validation run sent ahead but did not reach (a shorter limit than planned) are let go.
        if self.remote_target is not None:
            self.remote_target.forget("val")

    def teardown(self, stage: str) -> None:
        if self.remote_target is not None:
            self.remote_target.close()
            self.remote_target = None

    # --- Lightning hooks -----------------------------------------------------------------------

    def on_fit_end(self) -> None:
        # Once per fit, so a compiled entry point that ran out of variants (and ran unfused flex from then on,
        # a dense score matrix) is seen in the log rather than only in a slower step or an OOM.
        variants = compiled_variants()
        if variants:
            limit = torch._dynamo.config.recompile_limit
            spent = sorted(name for name, count in variants.items() if count >= limit)
            rank_zero_info(
                f"compiled attention variants per entry point (dynamo's limit {limit}): {variants}"
                + (f"; {spent} reached it and ran uncompiled past it" if spent else "")
            )

    def on_fit_start(self) -> None:
        self._check_target_dtype()
        self._check_fsdp1_units()
        self._start_remote_target()
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is not None:
            self._check_features_of(datamodule)
            check_row_positions(getattr(datamodule, "max_tokens", None), self.target.text_config)
            self.check_data(datamodule)

    def _check_features_of(self, datamodule: Any) -> None:
        manifest = getattr(datamodule, "features_manifest", None)
        # Once per directory: the target's digest reads its embedding and LM head.
        if manifest is None:
            return
        key = manifest.get("directory", id(manifest))
        if getattr(self, "_features_checked", None) != key:
            self.check_features(manifest)
            self._features_checked = key

    def _check_fsdp1_units(self) -> None:
        """Under ``FSDPStrategy`` (FSDP1) the target's decoder layers must be FSDP units of their own: the
        module's state dict leaves the target out (:meth:`FrozenTarget.state_dict`), which FSDP1 allows for
        whole units only (it refuses, at the first save, a unit whose parameters are missing; the rest of the
        target is FSDP-ignored, :meth:`_keep_target_out_of_fsdp1_units`)."""
        from lightning.pytorch.strategies import FSDPStrategy
        from torch.distributed.fsdp import FullyShardedDataParallel

        if not isinstance(self.trainer.strategy, FSDPStrategy) or getattr(
            self.target, "decoder_released", False
        ):
            return
        layers = self.target.decoder_layers
        if not all(isinstance(layer, FullyShardedDataParallel) for layer in layers):
            raise ValueError(
                f"FSDPStrategy did not wrap the target's decoder layers ({type(layers[0]).__name__}) as FSDP "
                "units; name their class in the strategy's auto_wrap_policy (e.g. "
                "[transformers.models.llama.modeling_llama.LlamaDecoderLayer])"
            )

    def check_data(self, datamodule: Any) -> None:
        """A family's checks of its hyperparameters against the data it is about to train on (the block
        drafts' mask token); the data module is set up by then. Nothing to check by default."""

    def on_validation_start(self) -> None:
        self._check_target_dtype()
        self._start_remote_target()
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is not None:
            self._check_features_of(datamodule)

    def _check_target_dtype(self) -> None:
        """A ``*-true`` precision casts the whole module, the frozen target included, after it was built:
        refuse a run whose target no longer has the ``target_dtype`` asked for."""
        wanted = self.hparams.get("target_dtype")
        if wanted is None:
            return
        wanted = as_dtype(wanted)
        actual = next(p.dtype for p in self.target.parameters() if p.is_floating_point())
        if actual != wanted:
            raise ValueError(
                f"target_dtype = {wanted} but the trainer's precision cast the target to {actual}; drop "
                "target_dtype or choose a precision that keeps it (e.g. bf16-mixed / 32-true)"
            )

    def training_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> dict[str, Any]:
        batch = self.with_remote_features(batch)
        if self.remote_target is not None:
            # On the progress bar too: how long this step waited for its target features.
            self.log(
                "target/wait_s", self.remote_target.last_wait_s, on_step=True, on_epoch=False, prog_bar=True
            )
            self.log(
                "target/units_in_flight", float(self.remote_target.ledger.units), on_step=True, on_epoch=False
            )
        return self._shared_step(batch, "train", batch_idx)

    def validation_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> dict[str, Any]:
        return self._shared_step(self.with_remote_features(batch), "val", batch_idx)

    def register_ratio_metrics(self, names: Iterable[str]) -> None:
        """Declare the metrics a family's ``DraftOutput.sums`` carries (call at the end of ``__init__``):
        each is logged as the ratio of its sums over steps and ranks, not as a per-step mean."""
        self.ratio_metrics = ratio_metrics(names)

    @property
    def draws(self) -> torch.Generator | None:
        """The generator of the running step's random draws (anchors, variable prefixes): seeded by the run's
        seed, the stage, the global step, the rank and the micro-batch (:mod:`lightning_drafts.training.step_draws`),
        so a resumed run draws what the uninterrupted one drew. ``None`` outside a training or validation step
        (``compute_loss`` called directly draws from the global RNG)."""
        return getattr(self, "_draws", None)

    def _shared_step(self, batch: Mapping[str, Tensor], stage: str, batch_idx: int) -> dict[str, Any]:
        trainer = self.trainer
        self._draws = micro_batch_generator(
            stage, batch_idx, trainer.global_step, trainer.global_rank, trainer.accumulate_grad_batches
        )
        try:
            output = self.compute_loss(batch)
        finally:
            self._draws = None
        real = batch["attention_mask"].shape[0] if "attention_mask" in batch else None
        self._log_loss(stage, output)
        for name, value in output.metrics.items():
            if name not in output.sums:
                self.log(f"{stage}/{name}", value, sync_dist=True, batch_size=real)
        for name, (numerator, denominator) in output.sums.items():
            metric = self._ratio_metric(stage, name)
            metric(numerator, denominator)
            self.log(f"{stage}/{name}", metric, on_step=stage == "train", on_epoch=stage != "train")
        return {"loss": output.loss, "draft_output": output.detach()}

    def _log_loss(self, stage: str, output: DraftOutput) -> None:
        """The loss is a mean over a micro-batch's supervised predictions, so it is logged as the ratio of
        ``loss * valid_tokens`` to ``valid_tokens`` summed over steps and ranks: an epoch weights each
        micro-batch by its count, and a micro-batch without any (its loss a structural zero) logs no point
        at all rather than a loss of 0 (the progress bar keeps the last real value)."""
        tokens = torch.as_tensor(output.valid_tokens, device=output.loss.device)
        metric = self.loss_sums[f"{stage}_loss"]
        metric(output.loss.detach() * tokens, tokens)
        if stage == "train":
            self.log("train/loss", metric, on_step=True, on_epoch=False, prog_bar=True)
            self.log("train/loss_epoch", metric, on_step=False, on_epoch=True)
        else:
            self.log(f"{stage}/loss", metric, on_step=False, on_epoch=True, prog_bar=True)

    def _ratio_metric(self, stage: str, name: str) -> RatioSum:
        registered = getattr(self, "ratio_metrics", {})
        key = f"{stage}_{name}"
        if key not in registered:
            raise ValueError(
                f"{type(self).__name__}.compute_loss returned sums for {name!r}, which was never registered; "
                "call self.register_ratio_metrics([...]) with every ratio name at the end of __init__"
            )
        return registered[key]

    def configure_callbacks(self) -> list[L.Callback]:
        # A user-configured AcceptanceCallback wins; otherwise a module still logs acceptance on its own.
        if any(isinstance(cb, AcceptanceCallback) for cb in self.trainer.callbacks):
            return []
        return [AcceptanceCallback()]

    def configure_optimizers(self) -> Any:
        params = [p for p in self.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(
            params,
            lr=self.hparams.learning_rate,
            betas=tuple(self.hparams.betas),
            weight_decay=self.hparams.weight_decay,
        )
        total = max(1, int(self.trainer.estimated_stepping_batches))
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda step: warmup_cosine(step, total, self.hparams.warmup_ratio, self.hparams.min_lr_ratio),
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Clip by norm under ``FSDPStrategy`` (FSDP1) through the root FSDP module's own
        ``clip_grad_norm_``, which reduces the norm over every rank's shards: Lightning's ``FSDPPrecision``
        refuses norm clipping (it has no handle on the root), and ``torch.nn.utils.clip_grad_norm_`` over one
        rank's shards would clip by a partial norm. Every other strategy clips as Lightning does."""
        from lightning.pytorch.strategies import FSDPStrategy

        by_norm = gradient_clip_algorithm is None or gradient_clip_algorithm == "norm"
        if gradient_clip_val and by_norm and isinstance(self.trainer.strategy, FSDPStrategy):
            self.trainer.strategy.model.clip_grad_norm_(gradient_clip_val)
            return
        self.clip_gradients(
            optimizer, gradient_clip_val=gradient_clip_val, gradient_clip_algorithm=gradient_clip_algorithm
        )

    def configure_model(self) -> None:
        """Activation checkpointing of the draft layers (any strategy), then FSDP2 under
        ``ModelParallelStrategy``: shard each draft layer, then each draft root module.

        The frozen target is replicated (it has no gradients or optimizer state to shard) unless
        ``shard_target``, which shards it per decoder layer for targets too large for one device.
        """
        draft_roots = [child for name, child in self.named_children() if name != "target"]
        if self.hparams.activation_checkpointing and not getattr(self, "_checkpointing_applied", False):
            from torch.distributed._composable import checkpoint

            for layer in (layer for root in draft_roots for layer in _repeated_layers(root)):
                checkpoint(layer)
            self._checkpointing_applied = True
        # Called again by every run (and by load_from_checkpoint, without a trainer): shard on the first
        # call that has a device mesh, whatever ran before it.
        self._keep_target_out_of_fsdp1_units()
        if self.device_mesh is None:
            if self.hparams.shard_target and self._trainer is not None:
                raise ValueError(
                    "shard_target=True needs ModelParallelStrategy (FSDP2), but this run has no device mesh; "
                    "use that strategy or set shard_target: false (FSDPStrategy wraps the target by its "
                    "auto_wrap_policy)"
                )
            return
        if not getattr(self, "_fsdp_applied", False):
            self._shard(draft_roots, self.device_mesh["data_parallel"])
            self._fsdp_applied = True

    def _keep_target_out_of_fsdp1_units(self) -> None:
        """Under ``FSDPStrategy`` (FSDP1), the target's embedding, final norm and LM head are FSDP-ignored
        modules: whole on every rank's device as under DDP or FSDP2, in no flat parameter. In the root unit's
        flat parameter beside the draft, every full-state-dict save would unshard them and copy them to rank
        0's CPU (~2 GB of Llama-3.1-8B's embedding and LM head in bf16) before the checkpoint dropped them.
        FSDP does not move ignored modules, so they are moved to the rank's device here."""
        from lightning.pytorch.strategies import FSDPStrategy

        if self._trainer is None or not isinstance(self.trainer.strategy, FSDPStrategy):
            return
        strategy = self.trainer.strategy
        # FSDP takes one of the two arguments, and ignored states of one kind; a user's own are kept. Ignored
        # as parameters unless the user gave modules (an ignored module takes its whole subtree with it).
        key = "ignored_modules" if strategy.kwargs.get("ignored_modules") is not None else "ignored_states"
        ignored = list(strategy.kwargs.get(key) or ())
        as_modules = any(isinstance(item, torch.nn.Module) for item in ignored)
        for module in self.target.outside_decoder():
            module.to(strategy.root_device)
            for item in [module] if as_modules else module.parameters(recurse=False):
                if not any(item is other for other in ignored):  # a tied LM head is the embedding
                    ignored.append(item)
        strategy.kwargs[key] = ignored

    def _shard(self, draft_roots: list[torch.nn.Module], data_parallel: Any) -> None:
        from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

        for root in draft_roots:
            for layer in _repeated_layers(root):
                fully_shard(layer, mesh=data_parallel)
            if any(p.requires_grad for p in root.parameters()):
                fully_shard(root, mesh=data_parallel)
                # FSDP2 unshards a root's weights when its `forward` runs and keeps them until backward,
                # so methods called after it (heads, TTT steps) see whole weights. A draft whose step
                # starts with another method (EAGLE-3) names it. Registering every TTT method instead
                # gave gradients up to 8% off DDP's in the 2-process test.
                entry = getattr(root, "fsdp_entry_method", None)
                if entry is not None:
                    register_fsdp_forward_method(root, entry)
        if self.hparams.shard_target:
            # Decoder layers only, each its own FSDP root told to reshard after forward (a root keeps
            # its weights otherwise, expecting a backward the frozen target never has). The embedding,
            # final norm and LM head stay whole: drafts and the varlen path call them outside any
            # forward, and frozen weights need no gradient reduction.
            for layer in self.target.decoder_layers:
                fully_shard(layer, mesh=data_parallel, reshard_after_forward=True)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # `lightning-drafts export` rebuilds the right family from the checkpoint alone.
        checkpoint["draft_class"] = self.draft_class_path()
        state = checkpoint.get("state_dict", {})
        for key in [k for k in state if k.startswith(TARGET_PREFIX)]:
            del state[key]
        # Lightning calls this hook last, so the digests cover the whole checkpoint.
        record_digests(checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        check_family(checkpoint, self.draft_class_path())
        if "state_dict" not in checkpoint:
            strategy = getattr(self._trainer, "strategy", None)
            # Sharded strategies (FSDP, FSDP2) load the module state themselves and remove it before this
            # hook; one device or DDP never does, nor does a load outside a trainer: there it is missing.
            if strategy is not None and type(strategy) not in (SingleDeviceStrategy, DDPStrategy):
                return
            # Lightning would next read checkpoint["state_dict"] and fail with a bare KeyError.
            check_digests(checkpoint, skip=("hyper_parameters",))
            raise ValueError(
                "the checkpoint holds no state_dict (the draft's weights): it is cut short or was not written "
                "by a lightning-drafts fit; use another checkpoint (e.g. an earlier last.ckpt or best.ckpt)"
            )
        expected = {k for k in self.state_dict() if not k.startswith(TARGET_PREFIX)}
        missing = sorted(expected - set(checkpoint["state_dict"]))
        if missing:
            raise ValueError(
                f"the checkpoint lacks draft weights {missing[:5]}{' ...' if len(missing) > 5 else ''}; "
                "it was written by a different draft configuration"
            )
        # load_from_checkpoint merges its keyword arguments into the hyperparameters before this hook; the
        # CLI and export check those against the file itself.
        check_digests(checkpoint, skip=("hyper_parameters",))

    def draft_class_path(self) -> str:
        """``module.Class`` of this draft: what its checkpoints record as their family."""
        return f"{type(self).__module__}.{type(self).__qualname__}"

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        # Checkpoints hold only the draft: the target keeps the weights it was built with (the target keys
        # of a checkpoint written before the target was left out of state dicts are passed over), and
        # strict loading asks for every key but the target's.
        state_dict = {key: value for key, value in state_dict.items() if not key.startswith(TARGET_PREFIX)}
        result = super().load_state_dict(state_dict, strict=False, assign=assign)
        missing = [key for key in result.missing_keys if not key.startswith(TARGET_PREFIX)]
        if strict and (missing or result.unexpected_keys):
            raise RuntimeError(
                f"Error(s) in loading state_dict for {type(self).__name__}: missing keys {missing[:5]}, "
                f"unexpected keys {result.unexpected_keys[:5]}"
            )
        # The target's keys are absent by design: reporting them would make Lightning warn on every load.
        return result._replace(missing_keys=missing)

    def export(self, output_dir: Path) -> Path:
        """Write the serving layout of this draft (implemented by each family)."""
        raise NotImplementedError(f"{type(self).__name__} has no serving export")

    def target_record(self) -> dict[str, Any]:
        """What an export records so that ``evaluate`` can rebuild the target without being told:
        the hub id / path / config dict (``None`` for a model instance) and the seed of a random one."""
        target = self.hparams.get("target")
        if isinstance(target, dict) and "vocab_size" not in target:
            # The CLI fills a config-dict target's vocabulary from the tokenizer; rebuild it with that size.
            target = {**target, "vocab_size": self.target.vocab_size}
        return {
            "target": target if isinstance(target, (str, dict)) else None,
            "target_seed": self.hparams.get("target_seed", 0),
        }

    def draft_state_dict(self) -> dict[str, Tensor]:
        """The draft's weights and buffers only (what checkpoints and exports hold)."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith(TARGET_PREFIX)}


def _repeated_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The elements of every ``ModuleList`` under ``module``: a draft's decoder layers, its FSDP units."""
    return [layer for child in module.modules() if isinstance(child, torch.nn.ModuleList) for layer in child]


def _with_tokenizer_vocab(target: TargetSpec, tokenizer_vocab_size: int | None) -> TargetSpec:
    if isinstance(target, dict) and tokenizer_vocab_size is not None and "vocab_size" not in target:
        return {**target, "vocab_size": tokenizer_vocab_size}
    return target
