"""AcceptanceCallback: per-position accuracy, acceptance length and valid tokens, logged per stage."""

from __future__ import annotations

from typing import Any

import lightning as L

from lightning_drafts.core.acceptance import AcceptanceStats
from lightning_drafts.core.draft_output import DraftOutput


class AcceptanceCallback(L.Callback):
    """Keeps integer-sum statistics of each step's :class:`DraftOutput` and logs them.

    Training figures cover one optimizer step (all its micro-batches); validation figures cover the
    whole validation epoch. Every rank updates and computes, so the sums are reduced across ranks.
    """

    def __init__(self) -> None:
        self.stats: dict[str, AcceptanceStats] = {}

    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._update("train", outputs, pl_module)
        closes_step = (batch_idx + 1) % trainer.accumulate_grad_batches == 0 or trainer.is_last_batch
        if closes_step:
            self._log_and_reset("train", pl_module, on_step=True)

    def on_validation_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._update("val", outputs, pl_module)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        stats = self._log_and_reset("val", pl_module, on_step=False)
        if stats is not None:
            self._draw_positions(trainer, stats)

    def _update(self, stage: str, outputs: Any, pl_module: L.LightningModule) -> None:
        draft = outputs.get("draft_output") if isinstance(outputs, dict) else None
        if not isinstance(draft, DraftOutput):
            return
        metric = self.stats.get(stage)
        if metric is None or metric.positions != draft.correct.shape[1]:
            metric = self.stats[stage] = AcceptanceStats(draft.correct.shape[1]).to(pl_module.device)
        metric.update(draft.correct, draft.valid, draft.valid_tokens)

    def _log_and_reset(self, stage: str, pl_module: L.LightningModule, on_step: bool) -> dict | None:
        metric = self.stats.get(stage)
        if metric is None or not metric.update_called:
            return None
        stats = metric.compute()
        for name, value in stats.items():
            # compute() already summed over ranks, so every rank holds this same value: a max over ranks
            # returns it exactly (a sum would double count) and tells Lightning it is synchronised.
            pl_module.log(
                f"{stage}/{name}",
                value,
                on_step=on_step,
                on_epoch=not on_step,
                prog_bar=name == "accept_len",
                sync_dist=not on_step,
                reduce_fx="max",
            )
        metric.reset()
        return stats

    def _draw_positions(self, trainer: L.Trainer, stats: dict) -> None:
        """Per-position accuracy as a TensorBoard histogram: bucket k holds acc_pos{k} (in percent)."""
        experiment = getattr(trainer.logger, "experiment", None)
        if not trainer.is_global_zero or not hasattr(experiment, "add_histogram_raw"):
            return
        accuracy = [float(stats[f"acc_pos{k}"]) for k in range(sum(n.startswith("acc_pos") for n in stats))]
        counts = [round(100 * a) for a in accuracy]
        experiment.add_histogram_raw(
            "val/acceptance_by_position",
            min=0,
            max=len(counts),
            num=max(1, sum(counts)),
            sum=float(sum(k * c for k, c in enumerate(counts))),
            sum_squares=float(sum(k * k * c for k, c in enumerate(counts))),
            bucket_limits=[k + 1 for k in range(len(counts))],
            bucket_counts=counts,
            global_step=trainer.global_step,
        )
