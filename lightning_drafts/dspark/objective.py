"""The DSpark three-term loss (dspark.md §8): ``ce`` + ``tv`` + ``conf``, decay-weighted per slot.

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
that of the global token-weighted mean (NeMo's normalisation, §8 / §17).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

# Reused, not copied: DSpark's position decay and epsilon are DFlash's (exp(-k / gamma), 1e-6).
from lightning_drafts.blockdraft.objective import LOSS_EPS, decay_weights

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


def distribution_terms(draft_logits: Tensor, teacher_logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """Per slot ``[..., ]``: fp32 cross-entropy against ``labels`` and the L1 distance between the draft
    and the (detached) teacher distributions over the last dimension."""
    log_probs = torch.log_softmax(draft_logits.float(), dim=-1)
    ce = -log_probs.gather(-1, labels[..., None].long()).squeeze(-1)
    teacher = torch.softmax(teacher_logits.detach().float(), dim=-1)
    l1 = (log_probs.exp() - teacher).abs().sum(dim=-1)
    return ce, l1


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
