"""A signal delivered twice (a scheduler repeating its SIGTERM, a Ctrl-C after a SIGTERM), before the step
boundary or while the checkpoint is being written, still saves ``last.ckpt`` once, of the step the first
signal stopped, and exits as that signal alone does (128 + its number). One fit in this process, no DDP:
the handlers are the callback's own, the same on every rank."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_drafts.callbacks.preemption import Preempted, PreemptionCheckpoint

STOPPED_AT = 2


class Signaller(L.Callback):
    """Sends ``first`` at the end of step ``STOPPED_AT``, and ``second`` right after it (``when="step"``)
    or from inside the checkpoint's writing (``when="saving"``); counts the checkpoints written."""

    def __init__(self, first: int, second: int, when: str) -> None:
        self.first, self.second, self.when = first, second, when
        self.saves = 0

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        if trainer.global_step == STOPPED_AT:
            os.kill(os.getpid(), self.first)
            if self.when == "step":
                os.kill(os.getpid(), self.second)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        self.saves += 1
        if self.when == "saving" and self.saves == 1:
            os.kill(os.getpid(), self.second)


@pytest.fixture
def handlers_restored():
    # Lightning ignores SIGINT for good after a KeyboardInterrupt; give the test process its own back.
    kept = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    yield
    for signum, handler in kept.items():
        signal.signal(signum, handler)


@pytest.mark.parametrize("when", ["step", "saving"])
@pytest.mark.parametrize(
    ("first", "second"),
    [(signal.SIGTERM, signal.SIGTERM), (signal.SIGTERM, signal.SIGINT)],
    ids=["term-term", "term-int"],
)
def test_a_repeated_signal_saves_the_step_once_and_exits_as_the_first_one(
    tmp_path: Path, handlers_restored, first, second, when
):
    signaller = Signaller(first, second, when)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=STOPPED_AT + 3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        callbacks=[signaller, PreemptionCheckpoint()],
    )
    with pytest.raises(Preempted) as stopped:
        trainer.fit(BoringModel())
    assert stopped.value.code == 128 + first == 143
    assert signaller.saves == 1
    assert stopped.value.path == tmp_path / "last.ckpt"
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert saved["global_step"] == STOPPED_AT
