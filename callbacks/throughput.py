"""ThroughputCallback: real (non-padding) tokens per second, documents per second, padding fraction, and
the real tokens trained on so far."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import lightning as L
import torch
from torch import Tensor


class ThroughputCallback(L.Callback):
    """Logs ``train/real_tokens_per_s``, ``train/samples_per_s`` and ``train/padding_fraction`` (this
    rank's), and ``train/tokens_seen``: the real tokens of every rank's batches since the run began, kept in
    the checkpoint so a resumed run counts on (a draft's curves compare across batch sizes and world sizes
    by tokens, not steps; TensorBoard stores it as a float32, exact up to 2**24 tokens).

    Padding is what packing removes, so the padding fraction of the rows is logged beside the speed:
    ``1 / (1 - padding_fraction)`` is the most a padded run could gain from packing.

    The rates are over the last ``window`` micro-batches: their tokens over the time from the end of the
    micro-batch before them to the end of the last (data loading included; a validation run starts the
    window afresh). Nothing here waits for the device or reads a count back to the host: the values stay
    device tensors until Lightning logs them, every ``log_every_n_steps``. CUDA runs ahead of the host, so
    one micro-batch's end on the host's clock is not its end on the device; over a window the difference is
    the host's lead at both ends, a bounded part of ``window`` steps, where a device synchronisation per
    micro-batch would instead stall the host's queueing of the next step behind the last.
    """

    # The host's clock (a test drives the rates with a clock of its own).
    _clock = staticmethod(time.perf_counter)

    def __init__(self, window: int = 20) -> None:
        if window < 1:
            raise ValueError(f"window must be at least 1 micro-batch, got {window}")
        self.window = window
        self._ends: deque[float] = deque(maxlen=window + 1)
        self._counts: deque[Tensor] = deque(maxlen=window)
        self._seen: Tensor | int = 0

    @property
    def tokens_seen(self) -> int:
        """The real tokens of every rank's batches so far (reading it waits for the device)."""
        return int(self._seen)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if not self._ends:
            self._ends.append(self._clock())

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._ends.clear()
        self._counts.clear()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not self._ends or "attention_mask" not in batch:
            return
        self._ends.append(self._clock())
        mask = batch["attention_mask"]
        real = mask.sum()
        documents = (
            (batch["seq_lens"] > 0).sum() if "seq_lens" in batch else torch.full_like(real, mask.shape[0])
        )
        self._counts.append(torch.stack([real.float(), documents.float()]))
        # Every rank adds the same sum, so rank 0's count, the one the checkpoint keeps, is the whole job's.
        everyone = trainer.strategy.reduce(real.to(torch.int64), reduce_op="sum")
        self._seen = everyone + self._seen
        pl_module.log("train/tokens_seen", self._seen.double(), on_step=True, on_epoch=False)
        seconds = max(self._ends[-1] - self._ends[-1 - len(self._counts)], 1e-9)
        tokens, samples = torch.stack(tuple(self._counts)).sum(0) / seconds
        pl_module.log("train/real_tokens_per_s", tokens, on_step=True, on_epoch=False)
        pl_module.log("train/samples_per_s", samples, on_step=True, on_epoch=False)
        pl_module.log("train/padding_fraction", 1.0 - real / mask.numel(), on_step=True, on_epoch=False)

    def state_dict(self) -> dict[str, Any]:
        return {"tokens_seen": self.tokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # 0 for a checkpoint of a run without the count.
        self._seen = int(state_dict.get("tokens_seen", 0))
