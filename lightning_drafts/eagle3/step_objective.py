"""The loss of one EAGLE-3 TTT step, chosen by ``lk_loss_type`` (docs/concepts/eagle3.md#loss).

Over the ``n`` slots supervised at the step (rows of the micro-batch, whatever row they sit in), with
the teacher ``P = softmax(teacher logits)`` over the draft vocabulary and the draft ``q = softmax(logits)``,
both in fp32 (in bf16 ``P - q`` cancels and the gradient shrinks as acceptance rises):

* ``None`` (default): soft cross-entropy ``-(1/n) sum sum_v P log q``.
* ``"alpha"`` (LK): ``-(1/n) sum log alpha`` with the per-token acceptance
  ``alpha = sum_v min(P, q)``; a token with ``alpha = 0`` contributes 0 (no usable direction).
* ``"lambda"`` (LK): ``kappa softCE + (1 - kappa) (1 - mean alpha)``,
  ``kappa = lk_kl_scale exp(-lk_kl_decay mean alpha)`` detached.

``mean alpha`` (and so ``kappa``) is taken per step over the micro-batch's supervised slots: no
collective, and the same set of slots whether the documents are packed into rows or padded one per row.
A step with no supervised slot contributes 0 (still weighted), as the soft cross-entropy does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_drafts.core.checks import is_number

LK_LOSS_TYPES = (None, "alpha", "lambda")


@dataclass(frozen=True)
class StepObjective:
    """NeMo's EAGLE-3 options: ``lk_loss_type`` None / "alpha" / "lambda", ``lk_kl_scale`` in [0, 1] (1.0),
    ``lk_kl_decay`` >= 0 (3.0)."""

    lk_loss_type: str | None = None
    lk_kl_scale: float = 1.0
    lk_kl_decay: float = 3.0

    def __post_init__(self) -> None:
        if self.lk_loss_type not in LK_LOSS_TYPES:
            raise ValueError(f"lk_loss_type {self.lk_loss_type!r} is unknown; choose one of {LK_LOSS_TYPES}")
        # kappa <= lk_kl_scale, so a scale in [0, 1] keeps the acceptance term's coefficient 1 - kappa
        # non-negative; above 1 it would reward a lower acceptance early in training.
        if not is_number(self.lk_kl_scale) or not 0 <= self.lk_kl_scale <= 1:
            raise ValueError(f"lk_kl_scale = {self.lk_kl_scale!r} must be a number in [0, 1]")
        if not is_number(self.lk_kl_decay) or not 0 <= self.lk_kl_decay < math.inf:
            raise ValueError(f"lk_kl_decay = {self.lk_kl_decay!r} must be a finite number >= 0")

    def step_loss(self, student_logits: Tensor, teacher_logits: Tensor) -> Tensor:
        """The step's loss from its supervised rows (``[n, V_d]`` each)."""
        count = student_logits.shape[0]
        teacher = torch.softmax(teacher_logits.float(), dim=-1)
        log_draft = torch.log_softmax(student_logits.float(), dim=-1)
        soft_ce = -(teacher * log_draft).sum(-1).sum()
        if self.lk_loss_type is None:
            return soft_ce / max(1, count)
        accept = torch.minimum(teacher, log_draft.exp()).sum(-1)
        if self.lk_loss_type == "alpha":
            # The floor keeps the unused branch finite: an inf there would NaN the backward at alpha = 0.
            safe_log = torch.log(accept.clamp(min=torch.finfo(accept.dtype).tiny))
            return -torch.where(accept > 0, safe_log, torch.zeros_like(accept)).sum() / max(1, count)
        if count == 0:
            # Without this the constant 1 - kappa would count a step with nothing to learn.
            return soft_ce * 0.0
        mean_accept = accept.sum() / count
        kappa = self.lk_kl_scale * torch.exp(-self.lk_kl_decay * mean_accept.detach())
        return kappa * soft_ce / count + (1.0 - kappa) * (1.0 - mean_accept)
