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


def nll_and_argmax(
    logits: Tensor, labels: Tensor, single_backward: bool = False, consume: bool = False
) -> tuple[Tensor, Tensor]:
    """fp32 cross-entropy of each position's ``logits [..., V]`` against ``labels [...]`` (differentiable in
    ``logits``) and its argmax ``[...]`` (the first maximal id, as ``Tensor.argmax``).

    ``single_backward``: one backward runs through the cross-entropy (one loss term reads it), so the
    gradient is written into the saved softmax instead of a new ``[n, V]`` tensor; a second backward
    then raises (the saved softmax was modified in place) instead of returning a wrong gradient.

    ``consume``: ``logits`` are a fresh projection nothing else reads (never a leaf): the softmax is written
    into them instead of into a second ``[n, V]`` tensor, and they hold it afterwards. Lower-precision
    logits are cast to a copy of their own, which is always reused so.
    """
    flat = logits if consume else logits.reshape(-1, logits.shape[-1])
    nll, predicted, _ = _GoldNll.apply(flat, labels.reshape(-1).long(), single_backward, consume)
    return nll.view(labels.shape), predicted.view(labels.shape)


def softmax_lse_argmax(values: Tensor, in_place: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """``softmax(values)`` of fp32 ``values [n, V]`` (written into ``values`` when ``in_place``), its
    log-sum-exp ``[n]`` and its argmax ``[n]`` (the first maximal id, as ``Tensor.argmax``) from one
    exponential sweep: the softmax's entry at the row maximum is ``exp(0) / sum_v exp(z_v - max z)``, so
    ``lse = max z - log p[argmax]``."""
    top, predicted = row_max(values)
    probs = torch.softmax(values, dim=-1, out=values) if in_place else torch.softmax(values, dim=-1)
    lse = top - probs.gather(-1, predicted[:, None]).squeeze(-1).log()
    return probs, lse, predicted


def softmax_into(logits: Tensor, consume: bool) -> tuple[Tensor, bool]:
    """``(values, writable)``: ``logits`` in fp32, and whether a softmax may be written into them. A cast
    copy always may; fp32 ``logits`` (``values`` is then ``logits`` itself, an input its Function must mark
    dirty) only when the caller hands them over (``consume``), as a flat ``[n, V]`` tensor of their own."""
    if consume and logits.dim() != 2:
        raise ValueError(
            f"consumed logits must be a flat [n, V] tensor, got shape {tuple(logits.shape)}: a reshaped view "
            "cannot be written into by an autograd Function; project flat rows, or pass consume=False"
        )
    values = logits.float()
    return values, consume or values is not logits


def softmax_cross_entropy(
    ctx: torch.autograd.function.FunctionCtx, logits: Tensor, labels: Tensor, consume: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """Inside an autograd Function's forward taking ``logits [n, V]``: ``(probs, nll, predicted)``, the fp32
    softmax (written into ``logits`` when :func:`softmax_into` allows), ``lse - z[label]`` and the argmax.
    Marks ``ctx``: the argmax non-differentiable, and ``logits`` dirty when the softmax was written into them
    (the Function must then return ``probs``, which is ``logits``), else ``probs`` non-differentiable; a
    gradient that never arrives is passed to backward as None, not a zero ``[n, V]`` tensor."""
    values, writable = softmax_into(logits, consume)
    # Read before the softmax may overwrite the logits.
    gold = values.gather(-1, labels[:, None]).squeeze(-1)
    probs, lse, predicted = softmax_lse_argmax(values, in_place=writable)
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(predicted)
    if writable and values is logits:
        ctx.mark_dirty(logits)
    else:
        ctx.mark_non_differentiable(probs)
    return probs, lse - gold, predicted


class _GoldNll(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, logits: Tensor, labels: Tensor, single_backward: bool, consume: bool
    ) -> tuple[Tensor, Tensor, Tensor]:
        probs, nll, predicted = softmax_cross_entropy(ctx, logits, labels, consume)
        ctx.save_for_backward(probs, labels)
        ctx.dtype, ctx.single_backward = logits.dtype, single_backward
        # The softmax is returned (and dropped by the caller) because autograd needs a dirty input back.
        return nll, predicted, probs

    @staticmethod
    @once_differentiable
    def backward(
        ctx, grad_nll: Tensor | None, _: Tensor | None, __: Tensor | None
    ) -> tuple[Tensor | None, None, None, None]:
        if grad_nll is None:
            return None, None, None, None
        probs, labels = ctx.saved_tensors
        scale = grad_nll.float()[:, None]
        grad = probs.mul_(scale) if ctx.single_backward else probs * scale
        grad.scatter_add_(-1, labels[:, None], -scale)
        return grad.to(ctx.dtype), None, None, None
