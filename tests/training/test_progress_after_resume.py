"""The console bar of a run bounded by ``max_steps`` and resumed mid-epoch ends full: its count (the
epoch's batches, from the epoch's start) reaches its total exactly at the last step, for the rich bar and
the tqdm one, with one batch a step or two. Lightning bounded the total by the steps left since the resume
(``200/77``), and counted a step as one batch whatever the accumulation."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_drafts.callbacks.progress import DraftRichProgressBar, DraftTQDMProgressBar

# BoringModel's epoch: 64 random samples, batches of 2 (32 batches). Saved at step 4, resumed to step 10.
SAVED_AT, MAX_STEPS, EPOCH_BATCHES = 4, 10, 32


class BarReading(L.Callback):
    """The train bar's (count, total) after every batch (the bar updates before this, placed after it)."""

    def __init__(self) -> None:
        self.readings: list[tuple[float, float | None]] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        bar = next(
            c for c in trainer.callbacks if isinstance(c, (DraftRichProgressBar, DraftTQDMProgressBar))
        )
        if isinstance(bar, DraftRichProgressBar):
            task = bar.progress.tasks[bar.train_progress_bar_id]
            self.readings.append((task.completed, task.total))
        else:
            self.readings.append((bar.train_progress_bar.n, bar.train_progress_bar.total))


def fit(
    tmp_path: Path, bar: L.Callback, accumulate: int, max_steps: int, ckpt_path: str | None = None
) -> BarReading:
    reading = BarReading()
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=-1,
        max_steps=max_steps,
        accumulate_grad_batches=accumulate,
        logger=False,
        limit_val_batches=0,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[
            bar,
            reading,
            ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=SAVED_AT, save_top_k=-1),
        ],
    )
    trainer.fit(BoringModel(), ckpt_path=ckpt_path)
    return reading


@pytest.mark.parametrize("accumulate", [1, 2])
@pytest.mark.parametrize("bar", [DraftRichProgressBar, DraftTQDMProgressBar])
def test_a_bar_resumed_mid_epoch_counts_to_its_total_at_the_last_step(tmp_path, bar, accumulate):
    saved, end = SAVED_AT * accumulate, MAX_STEPS * accumulate  # the batches of those steps
    first = fit(tmp_path, bar(), accumulate, SAVED_AT).readings
    assert first == [(n, saved) for n in range(1, saved + 1)], first
    (checkpoint,) = tmp_path.glob(f"*step={SAVED_AT}.ckpt")
    readings = fit(tmp_path, bar(), accumulate, MAX_STEPS, str(checkpoint)).readings
    assert end < EPOCH_BATCHES  # the run ends inside the epoch it resumed
    # The bar counts the epoch's batches after the saved step's, out of the batch the last step ends at.
    assert readings == [(n, end) for n in range(saved + 1, end + 1)], readings
