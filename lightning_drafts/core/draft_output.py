"""DraftOutput: what every draft's objective returns."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import Tensor


@dataclass
class DraftOutput:
    """The loss of one micro-batch and its prediction chains.

    ``correct`` and ``valid`` are bool ``[M, K]``: M chains of K positions (see
    :mod:`lightning_drafts.core.acceptance`); ``correct`` is only meaningful where ``valid``.
    ``valid_tokens`` counts supervised predictions (it can differ from ``valid.sum()``, e.g. EAGLE-3
    drops out-of-draft-vocabulary targets from the loss but keeps them as chain misses); ``metrics``
    holds family-specific scalars to log (e.g. ``candidate_recall``); ``sums`` holds, for those of them
    that are ratios, the exact ``(numerator, denominator)`` the module logs as a ratio of sums over steps
    and ranks (:mod:`lightning_drafts.core.ratio_metric`).
    """

    loss: Tensor
    correct: Tensor
    valid: Tensor
    valid_tokens: Tensor | None = None
    metrics: dict[str, Tensor] = field(default_factory=dict)
    sums: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.correct.shape != self.valid.shape or self.correct.dim() != 2:
            raise ValueError(
                f"DraftOutput.correct and .valid must both be [M, K], got {tuple(self.correct.shape)} and "
                f"{tuple(self.valid.shape)}"
            )
        if self.valid_tokens is None:
            self.valid_tokens = self.valid.sum()

    def among_chains(self, kept: Tensor) -> DraftOutput:
        """This output's chains as the rows ``kept`` (bool ``[M]``) of ``M`` chains, the other rows never
        valid (and never correct): a chain without a valid position counts in no statistic."""
        if int(kept.sum()) != self.valid.shape[0]:
            raise ValueError(f"kept marks {int(kept.sum())} chains but the output has {self.valid.shape[0]}")
        shape = (kept.shape[0], self.valid.shape[1])
        valid = torch.zeros(shape, dtype=torch.bool, device=self.valid.device)
        correct = torch.zeros_like(valid)
        valid[kept], correct[kept] = self.valid, self.correct
        return replace(self, correct=correct, valid=valid)

    def detach(self) -> DraftOutput:
        return DraftOutput(
            loss=self.loss.detach(),
            correct=self.correct.detach(),
            valid=self.valid.detach(),
            valid_tokens=torch.as_tensor(self.valid_tokens).detach(),
            metrics={k: v.detach() for k, v in self.metrics.items()},
            sums={name: (num.detach(), den.detach()) for name, (num, den) in self.sums.items()},
        )
