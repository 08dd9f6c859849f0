"""DSpark's diagnostics (dspark.md §9) as exact (numerator, denominator) sums, and the output carrying them.

* ``accept_rate_k{k}``: mean acceptance proxy ``alpha_k`` over supervised slots k (``accept_rate@k`` in
  NeMo; renamed for TensorBoard), ``accept_rate``: over all slots;
* ``tau``: NeMo's expected accepted length per verify round, ``1 + sum_k prod_{j<=k} alpha_j eval_j``
  averaged over blocks with a supervised slot (range ``[1, K + 1]``; assumes independent slots and
  teacher-forced prefixes, so it is optimistic). Not the contract's ``accept_len`` (greedy argmax ==
  gold); both are logged;
* confidence calibration (with a confidence head), decay-weighted: ``confidence_abs_error`` = mean
  ``|sigmoid(c) - alpha|``, ``confidence_bias`` = mean ``sigmoid(c) - alpha``,
  ``confidence_cumprod_bias`` = mean of ``prod_{j<=k} sigmoid(c_j) eval_j - prod_{j<=k} alpha_j eval_j``.

Ratios are kept as sums so a log over ranks and steps is the ratio of the sums, never a mean of ratios
(:class:`RatioSum`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor
from torchmetrics import Metric

from lightning_drafts.draft_output import DraftOutput

Sums = dict[str, tuple[Tensor, Tensor]]


def acceptance_sums(alpha: Tensor, valid: Tensor) -> Sums:
    """``accept_rate_k{k}``, ``accept_rate`` and ``tau`` sums from ``[M, K]`` ``alpha`` and eval mask."""
    accepted = alpha.float() * valid
    counts = valid.float()
    sums = {f"accept_rate_k{k}": (accepted[:, k].sum(), counts[:, k].sum()) for k in range(alpha.shape[1])}
    sums["accept_rate"] = (accepted.sum(), counts.sum())
    scored = valid.any(dim=1)
    tau = 1.0 + accepted.cumprod(dim=1).sum(dim=1)
    sums["tau"] = ((tau * scored).sum(), scored.float().sum())
    return sums


def confidence_sums(confidence_logits: Tensor, alpha: Tensor, valid: Tensor, weights: Tensor) -> Sums:
    """Decay-weighted confidence calibration sums from ``[M, K]`` logits, ``alpha``, eval mask and weights."""
    predicted = torch.sigmoid(confidence_logits.float())
    error = predicted - alpha.float()
    chained = (predicted * valid).cumprod(dim=1) - (alpha.float() * valid).cumprod(dim=1)
    total = weights.sum()
    return {
        "confidence_abs_error": ((weights * error.abs()).sum(), total),
        "confidence_bias": ((weights * error).sum(), total),
        "confidence_cumprod_bias": ((weights * chained).sum(), total),
    }


def ratio(numerator: Tensor, denominator: Tensor) -> Tensor:
    """``numerator / denominator``, 0 where nothing was counted."""
    return torch.where(denominator > 0, numerator / denominator.clamp(min=1e-12), torch.zeros_like(numerator))


@dataclass
class DSparkOutput(DraftOutput):
    """A :class:`DraftOutput` whose ``sums`` hold each ratio metric as ``(numerator, denominator)``.

    ``metrics`` holds the per-micro-batch values of those ratios too, plus the local loss terms
    (``ce_loss``, ``tv_loss``, ``confidence_loss``) and the block count.
    """

    sums: Sums = field(default_factory=dict)

    def detach(self) -> DSparkOutput:
        base = super().detach()
        return DSparkOutput(
            loss=base.loss,
            correct=base.correct,
            valid=base.valid,
            valid_tokens=base.valid_tokens,
            metrics=base.metrics,
            sums={name: (num.detach(), den.detach()) for name, (num, den) in self.sums.items()},
        )


class RatioSum(Metric):
    """``sum(numerator) / sum(denominator)`` over steps and ranks (0 before anything was counted)."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("numerator", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("denominator", default=torch.zeros((), dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, numerator: Tensor, denominator: Tensor) -> None:
        self.numerator += numerator.detach().double()
        self.denominator += denominator.detach().double()

    def compute(self) -> Tensor:
        return ratio(self.numerator, self.denominator).float()
