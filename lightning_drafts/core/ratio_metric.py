"""Ratio metrics kept as exact ``(numerator, denominator)`` sums.

A draft's diagnostic ratios (DSpark's acceptance proxies and calibration, DFlash2's candidate recall)
are logged as the ratio of sums over steps and ranks, never as a mean of per-step ratios: a step with
few supervised slots then weighs what it counts, and a step with none adds nothing. A ratio with nothing
counted has no value (``None``), which Lightning logs as no point, not as 0.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn
from torchmetrics import Metric

Sums = dict[str, tuple[Tensor, Tensor]]
STAGES = ("train", "val")


def ratio(numerator: Tensor, denominator: Tensor) -> Tensor:
    """``numerator / denominator``, 0 where nothing was counted."""
    return torch.where(denominator > 0, numerator / denominator.clamp(min=1e-12), torch.zeros_like(numerator))


class RatioSum(Metric):
    """``sum(numerator) / sum(denominator)`` over steps and ranks; ``None`` while nothing was counted.

    Lightning logs a metric's per-step value from its last ``forward`` and its epoch value from
    ``compute``; a ``None`` in either is skipped. So a training step that counts nothing logs no point
    (skipping ``self.log`` instead would re-log the previous step's value: Lightning keeps it for the epoch).
    """

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("numerator", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("denominator", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def reset(self) -> None:
        # A validation reset runs under inference mode, whose fresh states a later fit (no_grad) could not
        # update in place: trainer.validate(...) then trainer.fit(...) would fail at fit's validation.
        with torch.inference_mode(False):
            super().reset()

    def update(self, numerator: Tensor, denominator: Tensor) -> None:
        self.numerator += numerator.detach().double()
        self.denominator += denominator.detach().double()

    def compute(self) -> Tensor | None:
        if not self.denominator > 0:
            return None
        return (self.numerator / self.denominator).float()


def ratio_metrics(names: Iterable[str]) -> nn.ModuleDict:
    """One :class:`RatioSum` per stage and name, keyed ``"{stage}_{name}"``."""
    return nn.ModuleDict({f"{stage}_{name}": RatioSum() for stage in STAGES for name in names})
