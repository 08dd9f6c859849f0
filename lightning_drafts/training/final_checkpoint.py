"""FinalCheckpoint: a fit that finishes leaves a resumable ``last.ckpt``, validation or not.

``ModelCheckpoint`` saves only after a validation, so a fit without one (``val_fraction: 0``,
``limit_val_batches: 0``) would train, exit 0 and write nothing; a fit whose last validation came before
``max_steps`` would keep a ``last.ckpt`` of an earlier step. Here the final step is saved where
``--ckpt_path last`` finds it, unless a ``ModelCheckpoint`` already saved that very step there. Without
validation a checkpoint monitored on a validation metric (``best.ckpt`` on ``val/accept_len``) can never
be written: the fit says so once, at its start.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_drafts.callbacks.preemption import PreemptionCheckpoint


class FinalCheckpoint(L.Callback):
    """Save ``last.ckpt`` at the end of a finished fit when no ``ModelCheckpoint`` saved its last step."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if has_validation(trainer):
            return
        monitored = sorted(
            {
                str(callback.monitor)
                for callback in trainer.checkpoint_callbacks
                if isinstance(callback, ModelCheckpoint) and callback.monitor is not None
            }
        )
        if monitored:
            rank_zero_info(
                f"no validation in this fit: no checkpoint monitored on {', '.join(monitored)} (best.ckpt) can be "
                f"written; last.ckpt is saved at its end ({PreemptionCheckpoint.checkpoint_path(trainer)})"
            )

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        path = PreemptionCheckpoint.checkpoint_path(trainer)
        if any(
            _saved_step_at(callback, path, trainer.global_step) for callback in trainer.checkpoint_callbacks
        ):
            return
        # A whole, resumable checkpoint (optimizer, loops, callbacks); said, so Lightning does not log its default.
        trainer.save_checkpoint(path, weights_only=False)


def has_validation(trainer: L.Trainer) -> bool:
    """Whether the fit validates at all: validation is enabled and the data module holds held-out data
    (a data module without ``val_documents``, a user's own, is taken at its word)."""
    if not trainer.limit_val_batches or not is_overridden("validation_step", trainer.lightning_module):
        return False
    datamodule = getattr(trainer, "datamodule", None)
    if datamodule is None or not hasattr(datamodule, "val_documents"):
        return True
    documents = datamodule.val_documents
    return documents is not None and len(documents) > 0


def _saved_step_at(callback: object, path: Path, step: int) -> bool:
    if not isinstance(callback, ModelCheckpoint):
        return False
    saved = {callback.last_model_path, callback.best_model_path}
    return Path(path).resolve() in {Path(p).resolve() for p in saved if p} and (
        callback._last_global_step_saved == step
    )
