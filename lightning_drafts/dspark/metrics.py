"""DSpark's diagnostics (docs/concepts/dspark.md#metrics) as exact (numerator, denominator) sums.

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
(:mod:`lightning_drafts.core.ratio_metric`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_drafts.core.ratio_metric import Sums


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
