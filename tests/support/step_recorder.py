"""StepRecorder: a test callback that writes what every training step of every rank did, and can hold a
run at a chosen step for the test to signal or kill it there.

Each rank appends one JSON line per step to ``<out>/steps-<launch>-rank<r>.jsonl``: the global step, the
epoch, the micro-batch loss (exact, as ``float.hex``) and a digest of every document the micro-batch held
(its tokens and loss mask between the ``seq_lens`` boundaries). Documents are named by their content, not
by any index of the loader under test, so a count of them checks the loader independently.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch

from lightning_drafts.callbacks.preemption import PreemptionCheckpoint


def document_digests(batch: dict[str, torch.Tensor]) -> list[str]:
    """One digest per real document of a packed micro-batch (trailing padding is folded into the last
    document of a row, so only the real tokens of each are read)."""
    digests = []
    for row in range(batch["input_ids"].shape[0]):
        start = 0
        real = batch["attention_mask"][row].bool()
        for length in batch["seq_lens"][row].tolist():
            if length == 0:
                continue
            span = slice(start, start + length)
            tokens = batch["input_ids"][row, span][real[span]]
            mask = batch["loss_mask"][row, span][real[span]]
            start += length
            if tokens.numel():
                digests.append(document_digest(tokens.numpy(), mask.numpy()))
    return digests


def document_digest(tokens: np.ndarray, loss_mask: np.ndarray) -> str:
    payload = np.asarray(tokens, dtype=np.int64).tobytes() + np.asarray(loss_mask, dtype=np.int8).tobytes()
    return hashlib.sha256(payload).hexdigest()[:20]


class StepRecorder(L.Callback):
    """Record every step (see the module docstring); at ``hold_at_step`` rank 0 writes ``<out>/held`` and
    waits: ``until="signal"`` until the run's PreemptionCheckpoint has received a signal, ``"kill"`` forever
    (the test kills the process group)."""

    def __init__(self, out: str, launch: str, hold_at_step: int = 0, until: str = "signal") -> None:
        self.out = Path(out)
        self.launch = launch
        self.hold_at_step = hold_at_step
        self.until = until

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ):
        record = {
            "step": int(trainer.global_step),
            "epoch": int(trainer.current_epoch),
            "loss": float(outputs["loss"].detach()).hex(),
            "documents": document_digests(batch),
        }
        path = self.out / f"steps-{self.launch}-rank{trainer.global_rank}.jsonl"
        with open(path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        if trainer.global_step == self.hold_at_step and trainer.global_rank == 0:
            (self.out / "held").write_text(str(os.getpid()))
            preemption = next(c for c in trainer.callbacks if isinstance(c, PreemptionCheckpoint))
            while self.until == "kill" or preemption._signum is None:
                time.sleep(0.02)

    def on_train_end(self, trainer: L.Trainer, pl_module: Any) -> None:
        if trainer.global_rank == 0:
            torch.save(pl_module.draft_state_dict(), self.out / f"weights-{self.launch}.pt")
