"""The console progress bar of ``lightning-drafts fit`` / ``validate``: Lightning's own, less what misleads.

Lightning's bars show the logger's run version as ``v_num`` beside the metrics, as if it were one, and
the rich bar prints a run bounded by ``max_steps`` (``max_epochs`` -1, unbounded) as ``Epoch 0/-2``.

After a mid-epoch resume the bars count the epoch's batches from its start (the batch index goes on from
the checkpoint's), but Lightning bounds their total by the steps left *since the resume*: a run resumed at
step 123 of 200 showed ``200/77``, and the tqdm bar, whose total is only set at an epoch's start, showed no
total at all; with ``accumulate_grad_batches`` above 1 it took a step for one batch, so the count outran the
total in any run. Here the total is the batch the epoch ends at, counted from the epoch's start too.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import convert_inf

# Lightning's version number of the run, which its bars add to the metrics.
VERSION_ITEM = "v_num"


def epoch_end_batch(trainer: L.Trainer) -> int | float:
    """The batch count of the running epoch at which its bar is full: the epoch's length, or, in a run
    bounded by ``max_steps``, the batch that reaches it: the batches this epoch already ran (resumed ones
    included) plus those of the steps left, ``accumulate_grad_batches`` each, less those already
    accumulated toward the next step (Lightning counted one batch a step)."""
    batches = trainer.num_training_batches
    if trainer.max_epochs == -1 and trainer.max_steps is not None and trainer.max_steps > 0:
        ran = trainer.fit_loop.epoch_loop.batch_progress.current.processed
        accumulate = trainer.accumulate_grad_batches
        left = (trainer.max_steps - trainer.global_step) * accumulate - ran % accumulate
        return min(batches, ran + left)
    return batches


class DraftRichProgressBar(RichProgressBar):
    """Lightning's rich progress bar without ``v_num``, without an epoch bound a run does not have, and
    with a total that holds after a mid-epoch resume."""

    @property
    def total_train_batches(self) -> int | float:
        return epoch_end_batch(self.trainer)

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        return _without_version(super().get_metrics(trainer, pl_module))

    def _get_train_description(self, current_epoch: int) -> str:
        if self.trainer.max_epochs is not None and self.trainer.max_epochs >= 0:
            return super()._get_train_description(current_epoch)
        # The padding keeps the bar from shifting when the validation bar's longer description appears.
        return f"{f'Epoch {current_epoch}':{len(self.validation_description)}}"


class DraftTQDMProgressBar(TQDMProgressBar):
    """Lightning's tqdm progress bar without ``v_num``, with a total that holds after a mid-epoch resume
    (used where ``rich`` is not installed)."""

    @property
    def total_train_batches(self) -> int | float:
        return epoch_end_batch(self.trainer)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        # A mid-epoch resume skips on_train_epoch_start, where Lightning sets the bar's total and epoch.
        bar = self._train_progress_bar
        if bar is not None and bar.total is None:
            bar.total = convert_inf(self.total_train_batches)
            bar.set_description(f"Epoch {trainer.current_epoch}")
        super().on_train_batch_end(trainer, pl_module, *args)

    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, Any]:
        return _without_version(super().get_metrics(trainer, pl_module))


def console_progress_bar() -> ProgressBar:
    """The bar Lightning would pick (rich when installed, else tqdm), in its draft-training form."""
    return DraftRichProgressBar() if importlib.util.find_spec("rich") else DraftTQDMProgressBar()


def _without_version(items: dict[str, Any]) -> dict[str, Any]:
    items.pop(VERSION_ITEM, None)
    return items
