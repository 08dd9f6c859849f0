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
from lightning_drafts.training.checkpoint_integrity import check_digests, check_family, record_digests
from lightning_drafts.training.features_manifest import CaptureIdentity
from lightning_drafts.training.remote.config import RemoteOptions, RemoteTargetConfig, with_retired
from lightning_drafts.training.remote.feed import RemoteFeatures
from lightning_drafts.training.row_positions import check_row_positions
from lightning_drafts.training.sharding import (
    check_fsdp1_units,
    checkpoint_layers,
    clip_fsdp1_by_norm,
    keep_target_out_of_fsdp1_units,
    shard_fsdp2,
)
from lightning_drafts.training.step_draws import micro_batch_generator
from lightning_drafts.training.target import FrozenTarget, TargetOutput, TargetSpec, as_dtype

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
        remote: run the target on its own Ray workers, and cache what they send (see
            :class:`~lightning_drafts.training.remote.config.RemoteTargetConfig` and
            docs/guides/disaggregated.md); unset, the target runs in the trainer's process.
        tokenizer_vocab_size, pad_token_id: linked from the data module by the CLI. A config-dict
            target without ``vocab_size`` takes the tokenizer's; a larger tokenizer than the target's
            vocabulary is refused.
    """

    # Where checkpoints of earlier releases record this class (``module.Class``), if it has moved since:
    # they load as this class.
    former_class_paths: tuple[str, ...] = ()

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
        remote: RemoteOptions | None = None,
        tokenizer_vocab_size: int | None = None,
        pad_token_id: int | None = None,
        **retired: Any,
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
        # A checkpoint written when these options were flat arguments (target_workers, ...) still loads; the
        # hyperparameters record them as the one argument they are now.
        remote = with_retired(remote, retired)
        config = RemoteTargetConfig.of(remote)
        ignored = ["target"] if isinstance(target, PreTrainedModel) else []
        self.save_hyperparameters(ignore=[*ignored, *retired])
        target = _with_tokenizer_vocab(target, tokenizer_vocab_size)
        if config.workers and not isinstance(target, (str, dict)):
            raise ValueError(
                "remote.workers needs a target the workers can build themselves: a hub id / path or a config "
                f"dict, not a {type(target).__name__} instance"
            )
        # What a target worker builds: the trainer's own target (an instance is not kept twice: as an
        # attribute of a module it would become a submodule, and its weights checkpoint keys).
        target_args = {
            "target": target if isinstance(target, (str, dict)) else None,
            "attn_backend": target_attn_backend,
            "dtype": target_dtype,
            "seed": target_seed,
        }
        self.remote_features = RemoteFeatures(config, target_args, self)
        self.target = FrozenTarget(
            target,
            attn_backend=target_attn_backend,
            dtype=target_dtype,
            seed=target_seed,
            # The workers run the decoder; the trainer reads only the embedding, final norm and LM head.
            decoder=target_decoder and not config.workers,
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

    def capture_identity(self) -> CaptureIdentity:
        """What a features directory captured for this draft records (its manifest's identity fields)."""
        target = self.hparams.get("target")
        return CaptureIdentity(
            request=self.feature_request(),
            target_identity=self.target.identity(),
            target_spec=target if isinstance(target, (str, dict)) else None,
            draft_class=self.draft_class_path(),
        )

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
        check_fsdp1_units(self.trainer.strategy, self.target)
        self.remote_features.start(self.trainer)
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is not None:
            self.check_features_of(datamodule)
            check_row_positions(getattr(datamodule, "max_tokens", None), self.target.text_config)
            self.check_data(datamodule)

    def check_features_of(self, datamodule: Any) -> None:
        """:meth:`check_features` of the features directory ``datamodule`` trains from, if any (once per
        directory: the target's digest reads its embedding and LM head)."""
        manifest = getattr(datamodule, "features_manifest", None)
        if manifest is None:
            return
        key = manifest.get("directory", id(manifest))
        if getattr(self, "_features_checked", None) != key:
            self.check_features(manifest)
            self._features_checked = key

    def check_data(self, datamodule: Any) -> None:
        """A family's checks of its hyperparameters against the data it is about to train on (the block
        drafts' mask token); the data module is set up by then. Nothing to check by default."""

    def on_validation_start(self) -> None:
        self._check_target_dtype()
        self.remote_features.start(self.trainer)
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is not None:
            self.check_features_of(datamodule)

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

    # --- the target on its own workers: each batch's features join it before it moves to the device ----

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        return self.remote_features.add_features(batch, self.trainer, dataloader_idx)

    def on_train_epoch_start(self) -> None:
        self.remote_features.on_train_epoch_start()

    def on_train_epoch_end(self) -> None:
        self.remote_features.on_train_epoch_end(self.trainer)

    def on_validation_epoch_start(self) -> None:
        self.remote_features.on_validation_epoch_start()

    def on_validation_epoch_end(self) -> None:
        self.remote_features.on_validation_epoch_end()

    def teardown(self, stage: str) -> None:
        self.remote_features.close()

    def training_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> dict[str, Any]:
        remote = self.remote_features.remote
        if remote is not None:
            # On the progress bar too: how long this step waited for its target features.
            self.log("target/wait_s", remote.last_wait_s, on_step=True, on_epoch=False, prog_bar=True)
            self.log("target/units_in_flight", float(remote.ledger.units), on_step=True, on_epoch=False)
        return self._shared_step(batch, "train", batch_idx)

    def validation_step(self, batch: Mapping[str, Tensor], batch_idx: int) -> dict[str, Any]:
        return self._shared_step(batch, "val", batch_idx)

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
        """Clip by norm under ``FSDPStrategy`` (FSDP1) through the root FSDP module
        (:func:`~lightning_drafts.training.sharding.clip_fsdp1_by_norm`); every other strategy clips as
        Lightning does."""
        if clip_fsdp1_by_norm(self.trainer.strategy, gradient_clip_val, gradient_clip_algorithm):
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
            checkpoint_layers(draft_roots)
            self._checkpointing_applied = True
        # Called again by every run (and by load_from_checkpoint, without a trainer): shard on the first
        # call that has a device mesh, whatever ran before it.
        if self._trainer is not None:
            keep_target_out_of_fsdp1_units(self.trainer.strategy, self.target)
        if self.device_mesh is None:
            if self.hparams.shard_target and self._trainer is not None:
                raise ValueError(
                    "shard_target=True needs ModelParallelStrategy (FSDP2), but this run has no device mesh; "
                    "use that strategy or set shard_target: false (FSDPStrategy wraps the target by its "
                    "auto_wrap_policy)"
                )
            return
        if not getattr(self, "_fsdp_applied", False):
            shard_fsdp2(
                draft_roots, self.target, self.device_mesh["data_parallel"], self.hparams.shard_target
            )
            self._fsdp_applied = True

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # `lightning-drafts export` rebuilds the right family from the checkpoint alone.
        checkpoint["draft_class"] = self.draft_class_path()
        state = checkpoint.get("state_dict", {})
        for key in [k for k in state if k.startswith(TARGET_PREFIX)]:
            del state[key]
        # Lightning calls this hook last, so the digests cover the whole checkpoint.
        record_digests(checkpoint)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        check_family(checkpoint, self.draft_class_path(), former=self.former_class_paths)
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


def _with_tokenizer_vocab(target: TargetSpec, tokenizer_vocab_size: int | None) -> TargetSpec:
    if isinstance(target, dict) and tokenizer_vocab_size is not None and "vocab_size" not in target:
        return {**target, "vocab_size": tokenizer_vocab_size}
    return target
