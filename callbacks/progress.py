"""The console progress bar of ``lightning-drafts fit`` / ``validate``: Lightning's own, less what misleads.

Lightning's bars show the logger's run version as ``v_num`` beside the metrics, as if it were one, and
the rich bar prints a run bounded by ``max_steps`` (``max_epochs`` -1, unbounded) as ``Epoch 0/-2``.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar

# Lightning's version number of the run, which its bars add to the metrics.
VERSION_ITEM = "v_num"


class DraftRichProgressBar(RichProgressBar):
    """Lightning's rich progress bar without ``v_num``, and without an epoch bound a run does not have."""

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        return _without_version(super().get_metrics(trainer, pl_module))

    def _get_train_description(self, current_epoch: int) -> str:
        if self.trainer.max_epochs is not None and self.trainer.max_epochs >= 0:
            return super()._get_train_description(current_epoch)
        # The padding keeps the bar from shifting when the validation bar's longer description appears.
        return f"{f'Epoch {current_epoch}':{len(self.validation_description)}}"


class DraftTQDMProgressBar(TQDMProgressBar):
    """Lightning's tqdm progress bar without ``v_num`` (used where ``rich`` is not installed)."""

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        return _without_version(super().get_metrics(trainer, pl_module))


def console_progress_bar() -> ProgressBar:
    """The bar Lightning would pick (rich when installed, else tqdm), in its draft-training form."""
    return DraftRichProgressBar() if importlib.util.find_spec("rich") else DraftTQDMProgressBar()


def _without_version(items: dict[str, Any]) -> dict[str, Any]:
    items.pop(VERSION_ITEM, None)
    return items
