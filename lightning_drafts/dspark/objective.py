"""The DSpark three-term loss (docs/concepts/dspark.md#loss): ``ce`` + ``tv`` + ``conf``, decay-weighted per
slot.

Per supervised slot k (weight ``w_k = eval_k * exp(-k / gamma)``, 0-based k, uniform when gamma is
None):

* ``ce``: cross-entropy of the Markov-corrected draft logits against the gold next token;
* ``tv``: ``d_k = sum_v |p_draft - p_target|``, the L1 distance (= 2 x total variation, in [0, 2]; the
  name follows NeMo's logs) against the target's own next-token distribution, teacher detached;
* ``conf``: BCE of the confidence logit against ``alpha_k = clamp(1 - d_k / 2, 0, 1)``, the exact
  acceptance probability of a T = 1 speculative-sampling draft at this slot, detached.

Distribution math is fp32 whatever the model dtype (in bf16, ``p - q`` cancels as acceptance rises).
Each term is ``sum(w * term) / sum(w)`` over every slot of the micro-batch; under DDP / FSDP the
denominator is the all-rank sum and the loss is scaled by the world size, so the averaged gradient is
that of the global token-weighted mean (NeMo's normalisation).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import once_differentiable

# Reused, not copied: DSpark's position decay and epsilon are DFlash's (exp(-k / gamma), 1e-6).
from lightning_drafts.blockdraft.objective import LOSS_EPS, decay_weights
from lightning_drafts.core.gold_nll import softmax_cross_entropy, softmax_into
from lightning_drafts.core.row_blocks import row_blocks

__all__ = [
    "LOSS_EPS",
    "LossWeights",
    "acceptance_probability",
    "confidence_bce",
    "decay_weights",
    "distribution_terms",
    "global_weight_sum",
    "normalise",
]


@dataclass(frozen=True)
class LossWeights:
    """``ce_loss_alpha``, ``l1_loss_alpha`` and ``confidence_head_alpha`` (NeMo defaults 0.1 / 0.9 / 1.0)."""

    ce: float = 0.1
    tv: float = 0.9
    conf: float = 1.0

    def numerator(self, ce_sum: Tensor, tv_sum: Tensor, conf_sum: Tensor) -> Tensor:
        """``a_ce * ce + a_tv * tv + a_conf * conf``: the loss before its (data-only) denominator."""
        return self.ce * ce_sum + self.tv * tv_sum + self.conf * conf_sum


def distribution_terms(
    draft_logits: Tensor,
    teacher_logits: Tensor,
    labels: Tensor,
    teacher_index: Tensor | None = None,
    consume: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per slot ``[...]`` (``draft_logits`` ``[..., V]``, ``labels`` ``[...]``): fp32 cross-entropy against
    ``labels``, the L1 distance between the draft and the (detached) teacher distributions, differentiable
    in ``draft_logits``, and the draft's argmax (the first maximal id, as ``argmax``).

    ``teacher_logits`` are ``[..., V]`` aligned with the slots, or, with ``teacher_index`` (``[...]``
    indices into its rows), ``[u, V]`` logits of distinct teacher positions that several slots share:
    each teacher softmax is then computed once.

    ``consume``: both logits are fresh projections nothing else reads (the draft's never a leaf): each
    softmax is written into its logits instead of a second ``[n, V]`` / ``[u, V]`` tensor
    (:func:`~lightning_drafts.core.gold_nll.softmax_into`).
    """
    vocab = draft_logits.shape[-1]
    if teacher_index is not None:
        teacher_index = teacher_index.reshape(-1)
    flat = draft_logits if consume else draft_logits.reshape(-1, vocab)
    ce, l1, predicted, _ = _DistributionTerms.apply(
        flat, teacher_logits.detach().reshape(-1, vocab), labels.reshape(-1).long(), teacher_index, consume
    )
    return ce.view(labels.shape), l1.view(labels.shape), predicted.view(labels.shape)


class _DistributionTerms(torch.autograd.Function):
    """``ce = lse(z) - z[y]`` and ``l1 = sum_v |p_v - q_v|`` (``p = softmax(z)``, ``q`` the teacher's), with
    the gradient written out instead of differentiated op by op: each term's ``[n, V]`` chain (log-softmax,
    exp, difference, abs and their backward passes) would otherwise allocate and sweep a vocabulary-wide
    tensor per step, the bulk of the vocabulary terms' non-matmul time. With ``s = sign(p - q)``:

    ``d ce / d z = p - onehot(y)``, ``d l1 / d z = p * (s - <p, s>)``.

    ``lse`` comes from the softmax itself (:func:`~lightning_drafts.core.gold_nll.softmax_cross_entropy`).
    Everything that reads the teacher runs a block of rows at a time
    (:func:`~lightning_drafts.core.row_blocks.row_blocks`): a slot's teacher row is gathered into a block,
    never into an ``[n, V]`` copy, and its sign is taken again in backward instead of saved. Saved are the
    softmax ``p`` and the ``[u, V]`` teacher; the backward writes the gradient into ``p``, so it runs once
    (as after any backward that frees its graph).
    """

    @staticmethod
    def forward(
        ctx,
        draft_logits: Tensor,
        teacher_logits: Tensor,
        labels: Tensor,
        teacher_index: Tensor | None,
        consume: bool,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        probs, ce, predicted = softmax_cross_entropy(ctx, draft_logits, labels, consume)
        # The teacher's logits are detached: writing into them needs no mark.
        teacher, writable = softmax_into(teacher_logits, consume)
        teacher = torch.softmax(teacher, dim=-1, out=teacher) if writable else torch.softmax(teacher, dim=-1)
        if teacher_index is None:
            teacher_index = torch.arange(len(teacher), device=teacher.device)
        l1 = probs.new_empty(len(probs))
        for block in row_blocks(probs):
            # |q - p| is |p - q| to the bit: a float difference negates exactly.
            difference = teacher.index_select(0, teacher_index[block]).sub_(probs[block])
            torch.linalg.vector_norm(difference, ord=1, dim=-1, out=l1[block])
        ctx.save_for_backward(probs, teacher, teacher_index, labels)
        ctx.dtype, ctx.used = draft_logits.dtype, False
        # The softmax is returned (and dropped by the caller) because autograd needs a dirty input back.
        return ce, l1, predicted, probs

    @staticmethod
    @once_differentiable
    def backward(
        ctx, grad_ce: Tensor | None, grad_l1: Tensor | None, _: Tensor | None, __: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        if ctx.used:
            raise RuntimeError(
                "backward ran twice through the DSpark distribution terms, whose buffers the first backward "
                "reused; run one backward per forward (recompute the loss to differentiate it again)"
            )
        ctx.used = True
        probs, teacher, teacher_index, labels = ctx.saved_tensors
        if grad_ce is None and grad_l1 is None:
            return None, None, None, None, None
        grad_ce = probs.new_zeros(len(probs)) if grad_ce is None else grad_ce.float()
        grad_l1 = probs.new_zeros(len(probs)) if grad_l1 is None else grad_l1.float()
        for block in row_blocks(probs):
            p = probs[block]
            # -p s, exact (s is -1, 0 or 1): grad = g_l1 p s + p (g_ce - g_l1 <p, s>), written into p.
            negative = teacher.index_select(0, teacher_index[block]).sub_(p).sign_().mul_(p)
            scale = torch.addcmul(grad_ce[block], grad_l1[block], negative.sum(-1))
            torch.addcmul(negative.mul_(-grad_l1[block, None]), p, scale[:, None], out=p)
        probs.scatter_add_(-1, labels[:, None], -grad_ce[:, None])
        return probs.to(ctx.dtype), None, None, None, None


def acceptance_probability(l1: Tensor) -> Tensor:
    """``alpha = clamp(1 - L1 / 2, 0, 1) = 1 - TV``, detached (a target and a metric, never a gradient path)."""
    return (1.0 - 0.5 * l1.detach()).clamp(0.0, 1.0)


def confidence_bce(confidence_logits: Tensor, alpha: Tensor) -> Tensor:
    """Per-slot BCE-with-logits against the soft target ``alpha`` (its floor is the target's entropy, not 0)."""
    return torch.nn.functional.binary_cross_entropy_with_logits(
        confidence_logits.float(), alpha.detach().float(), reduction="none"
    )


def global_weight_sum(local: Tensor) -> tuple[Tensor, int]:
    """The loss denominator over every data-parallel rank, and the world size it was summed over.

    Only while gradients are on (training), where every rank runs every micro-batch anyway: validation
    keeps a local denominator so ranks with uneven validation batches never wait on each other.
    """
    if not (torch.is_grad_enabled() and dist.is_available() and dist.is_initialized()):
        return local, 1
    world = dist.get_world_size()
    if world == 1:
        return local, 1
    total = local.detach().clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total, world


def normalise(numerator: Tensor, weight_sum: Tensor) -> Tensor:
    """``W * numerator / (global sum w + 1e-6)`` (0 when nothing is supervised); see
    :meth:`LossWeights.numerator`."""
    denominator, world = global_weight_sum(weight_sum)
    return world * numerator / (denominator + LOSS_EPS)
