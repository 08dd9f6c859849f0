"""PreemptionCheckpoint: SIGTERM or Ctrl-C stops a fit at the next step boundary, saves a resumable
``last.ckpt`` and exits non-zero.

Schedulers (Slurm, Kubernetes) send SIGTERM some seconds before they kill a job. Lightning's own SIGTERM
handling stops the loop but exits 0 with nothing saved, and a Ctrl-C (``KeyboardInterrupt``) lands
anywhere, mid-backward included, where no consistent state exists to save. Here both signals only set a
flag; at the end of each training step every rank learns (one all-reduce) whether any rank was signalled,
and then all of them stop together after that step: the model, optimizer, scheduler, loops and loader
position saved are exactly those of a finished step, so ``fit --ckpt_path last`` continues the same
trajectory. A second Ctrl-C interrupts at once (and saves nothing); a second SIGTERM, or a Ctrl-C after a
SIGTERM, changes nothing: the step is saved once and the exit is the first signal's.

The checkpoint is written where ``--ckpt_path last`` finds it: ``last.ckpt`` in the directory of the first
``ModelCheckpoint`` (under the run's TensorBoard version), else in the trainer's ``default_root_dir``.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_info

HANDLED = (signal.SIGTERM, signal.SIGINT)


class Preempted(SystemExit):
    """The fit stopped on a signal after saving ``path``; exits with 128 + the signal number (the shell's
    convention: 143 for SIGTERM, 130 for SIGINT), so a job script sees that the run did not finish."""

    def __init__(self, signum: int, path: Path) -> None:
        super().__init__(128 + signum)
        self.signum = signum
        self.path = path


class PreemptionCheckpoint(L.Callback):
    """Save a resumable checkpoint when the fit receives SIGTERM or SIGINT, then exit non-zero."""

    def __init__(self) -> None:
        self._signum: int | None = None
        self._previous: dict[int, Any] = {}

    # Installed once training starts (Lightning registers its own SIGTERM handler just before), removed when
    # it ends: a signal during setup or the sanity check meets Lightning's and Python's defaults.
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._signum = None
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        for signum in HANDLED:
            self._previous[signum] = signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        # Only a second Ctrl-C stops at once. A scheduler repeats its SIGTERM, and a user may press Ctrl-C
        # after one: the first signal still decides, so the step is saved once and the exit is its own.
        if signum == signal.SIGINT and self._signum == signal.SIGINT:
            raise KeyboardInterrupt
        if self._signum is None:
            self._signum = signum
            # No logging from inside a signal handler (it may interrupt a log call holding its lock).

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        signum = self._agreed_signal(trainer)
        if signum is None:
            return
        path = self.checkpoint_path(trainer)
        rank_zero_info(
            f"received {signal.Signals(signum).name}: saving step {trainer.global_step} to {path} and stopping "
            "(resume with `fit --ckpt_path last`)"
        )
        # A whole, resumable checkpoint (optimizer, loops, callbacks); said, so Lightning does not log its default.
        trainer.save_checkpoint(path, weights_only=False)
        # The step is saved as done, so its metrics must reach the logger, which Lightning does only after
        # this hook: without this the TensorBoard curve would miss the step the run stopped at.
        connector = trainer._logger_connector
        connector.on_batch_end()
        connector.update_train_step_metrics()
        for logger in trainer.loggers:
            logger.save()
        raise Preempted(signum, path)

    def _agreed_signal(self, trainer: L.Trainer) -> int | None:
        """The signal any rank received (the largest number when they differ), the same on every rank."""
        local = self._signum or 0
        if trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            flag = torch.tensor([local], device=trainer.strategy.root_device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            local = int(flag.item())
        return local or None

    @staticmethod
    def checkpoint_path(trainer: L.Trainer) -> Path:
        """``last.ckpt`` beside the run's other checkpoints, where ``--ckpt_path last`` looks."""
        for callback in trainer.checkpoint_callbacks:
            if isinstance(callback, ModelCheckpoint) and callback.dirpath is not None:
                return Path(callback.dirpath) / f"{callback.CHECKPOINT_NAME_LAST}{callback.FILE_EXTENSION}"
        return Path(trainer.default_root_dir) / f"{ModelCheckpoint.CHECKPOINT_NAME_LAST}.ckpt"

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restore_handlers()

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self._restore_handlers()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._restore_handlers()

    def _restore_handlers(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}
