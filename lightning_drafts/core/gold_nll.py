"""Cross-entropy against a gold token and the argmax, from one softmax over the vocabulary.

``F.cross_entropy`` on ``[n, V]`` logits writes a log-softmax, then in backward a zero ``[n, V]``
gradient, its scatter and a log-softmax backward: three vocabulary-wide tensors and as many sweeps per
step. Written out, ``nll = lse(z) - z[y]`` and ``d nll / d z = softmax(z) - onehot(y)`` need the softmax
alone (:func:`softmax_lse_argmax`).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from lightning_drafts.core.row_top import row_max


def nll_and_argmax(logits: Tensor, labels: Tensor, single_backward: bool = False) -> tuple[Tensor, Tensor]:
    """fp32 cross-entropy of each position's ``logits [..., V]`` against ``labels [...]`` (differentiable in
    ``logits``) and its argmax ``[...]`` (the first maximal id, as ``Tensor.argmax``).

    ``single_backward``: one backward runs through the cross-entropy (one loss term reads it), so the
    gradient is written into the saved softmax instead of a new ``[n, V]`` tensor; a second backward
    then raises (the saved softmax was modified in place) instead of returning a wrong gradient.
    """
    vocab = logits.shape[-1]
    nll, predicted = _GoldNll.apply(logits.reshape(-1, vocab), labels.reshape(-1).long(), single_backward)
    return nll.view(labels.shape), predicted.view(labels.shape)


def softmax_lse_argmax(values: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``softmax(values)`` of fp32 ``values [n, V]``, its log-sum-exp ``[n]`` and its argmax ``[n]`` (the
    first maximal id, as ``Tensor.argmax``) from one exponential sweep: the softmax's entry at the row
    maximum is ``exp(0) / sum_v exp(z_v - max z)``, so ``lse = max z - log p[argmax]``."""
    top, predicted = row_max(values)
    probs = torch.softmax(values, dim=-1)
    lse = top - probs.gather(-1, predicted[:, None]).squeeze(-1).log()
    return probs, lse, predicted


class _GoldNll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, single_backward: bool) -> tuple[Tensor, Tensor]:
        values = logits.float()
        probs, lse, predicted = softmax_lse_argmax(values)
        nll = lse - values.gather(-1, labels[:, None]).squeeze(-1)
        ctx.save_for_backward(probs, labels)
        ctx.dtype, ctx.single_backward = logits.dtype, single_backward
        ctx.mark_non_differentiable(predicted)
        return nll, predicted

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_nll: Tensor, _: Tensor | None) -> tuple[Tensor | None, None, None]:
        probs, labels = ctx.saved_tensors
        scale = grad_nll.float()[:, None]
        grad = probs.mul_(scale) if ctx.single_backward else probs * scale
        grad.scatter_add_(-1, labels[:, None], -scale)
        return grad.to(ctx.dtype), None, None
