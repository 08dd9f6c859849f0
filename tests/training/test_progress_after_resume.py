"""The console bar of a run bounded by ``max_steps`` and resumed mid-epoch ends full: its count (the
epoch's batches, from the epoch's start) reaches its total exactly at the last step, for the rich bar and
the tqdm one. Lightning bounded the total by the steps left since the resume (``200/77``)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_drafts.callbacks.progress import DraftRichProgressBar, DraftTQDMProgressBar

# BoringModel's epoch: 64 random samples, batches of 2 (32 batches). Saved at step 8, resumed to step 20.
SAVED_AT, MAX_STEPS, EPOCH_BATCHES = 8, 20, 32


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


def fit(tmp_path: Path, bar: L.Callback, max_steps: int, ckpt_path: str | None = None) -> BarReading:
    reading = BarReading()
    trainer = L.Trainer(
        accelerator="cpu",
        max_epochs=-1,
        max_steps=max_steps,
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


@pytest.mark.parametrize("bar", [DraftRichProgressBar, DraftTQDMProgressBar])
def test_a_bar_resumed_mid_epoch_counts_to_its_total_at_the_last_step(tmp_path, bar):
    first = fit(tmp_path, bar(), SAVED_AT).readings
    assert first == [(n, SAVED_AT) for n in range(1, SAVED_AT + 1)], first
    (checkpoint,) = tmp_path.glob(f"*step={SAVED_AT}.ckpt")
    readings = fit(tmp_path, bar(), MAX_STEPS, str(checkpoint)).readings
    assert MAX_STEPS < EPOCH_BATCHES  # the run ends inside the epoch it resumed
    # The bar counts batches SAVED_AT + 1 .. MAX_STEPS of the epoch, out of the MAX_STEPS it ends at.
    assert readings == [(n, MAX_STEPS) for n in range(SAVED_AT + 1, MAX_STEPS + 1)], readings
