"""ThroughputCallback: real (non-padding) tokens per second, documents per second, padding fraction, and
the real tokens trained on so far."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch


class ThroughputCallback(L.Callback):
    """Logs ``train/real_tokens_per_s``, ``train/samples_per_s`` and ``train/padding_fraction`` (this
    rank's), and ``train/tokens_seen``: the real tokens of every rank's batches since the run began, kept in
    the checkpoint so a resumed run counts on (a draft's curves compare across batch sizes and world sizes
    by tokens, not steps; TensorBoard stores it as a float32, exact up to 2**24 tokens).

    Padding is what packing removes, so the padding fraction of the rows is logged beside the speed:
    ``1 / (1 - padding_fraction)`` is the most a padded run could gain from packing.
    """

    def __init__(self) -> None:
        self._start: float | None = None
        self.tokens_seen = 0

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._synchronize(pl_module)
        self._start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._start is None or "attention_mask" not in batch:
            return
        self._synchronize(pl_module)
        seconds = max(time.perf_counter() - self._start, 1e-9)
        mask = batch["attention_mask"]
        real = float(mask.sum())
        # Every rank adds the same sum, so rank 0's count, the one the checkpoint keeps, is the whole job's.
        everyone = trainer.strategy.reduce(mask.sum().to(torch.int64), reduce_op="sum")
        self.tokens_seen += int(everyone.item())
        pl_module.log("train/tokens_seen", float(self.tokens_seen), on_step=True, on_epoch=False)
        documents = float((batch["seq_lens"] > 0).sum()) if "seq_lens" in batch else float(mask.shape[0])
        pl_module.log("train/real_tokens_per_s", real / seconds, on_step=True, on_epoch=False)
        pl_module.log("train/samples_per_s", documents / seconds, on_step=True, on_epoch=False)
        pl_module.log("train/padding_fraction", 1.0 - real / mask.numel(), on_step=True, on_epoch=False)

    def state_dict(self) -> dict[str, Any]:
        return {"tokens_seen": self.tokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.tokens_seen = int(
            state_dict.get("tokens_seen", 0)
        )  # 0 for a checkpoint of a run without the count

    @staticmethod
    def _synchronize(pl_module: L.LightningModule) -> None:
        # CUDA kernels run asynchronously; without a sync the clock would measure launch time only.
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)
