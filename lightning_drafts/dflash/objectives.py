"""The DFlash / DFlash2 objectives chosen by ``loss_type`` (docs/concepts/dflash.md#objective,
docs/concepts/dflash.md#variable-prefix).

Per chain position ``j`` of block ``m`` (the drafted slots, blockdraft.objective): ``nll`` is the fp32
cross-entropy over the full vocabulary, ``p = exp(-nll)`` the draft's probability of the gold token,
``v`` the supervision bit and ``d_j = exp(-j / gamma)`` the decay. With a one-hot target (the data's
token) the LK per-token acceptance ``alpha = sum_v min(P, softmax(logits))`` is exactly ``p``. Every
term below weighs a position by ``v``, so the modules compute ``nll`` at the supervised positions only
(``block_valid_only``) and leave a finite placeholder elsewhere.

* ``dflash`` (default): ``sum d v nll / (sum d v + 1e-6)``, the decay-weighted mean over the micro-batch.
* ``dpace`` (D-PACE, SpecForge): detached ``s_j = (1 - a) p_j + a`` (``a = dpace_alpha``; 1 at an
  unsupervised position, so a hole neither breaks nor extends a block's prefix), ``P_j = prod_{i<=j} s_i``,
  weight ``w_j = v_j sum_{i>=j} P_i v_i``; ``-cumulative-confidence-only`` uses ``v_j P_j``,
  ``-continuation-value-only`` ``v_j sum_{i>=j} P_i v_i / P_j``. The decay is not used.
  Loss ``= (1 / D) sum_docs (1 / A_doc) sum_{m in doc} sum_j w nll``: ``A_doc`` counts the document's
  blocks with a supervised position and ``D`` the documents with one. SpecForge normalises per *row*;
  a row of a padded batch is one document, so the per-document unit is SpecForge's padded value and
  does not change when documents are packed together.
* ``lk-alpha``: ``-log alpha = nll`` with the ``dflash`` weights, i.e. the default objective itself.
* ``lk-tv``: ``sum d v (1 - alpha) / (sum d v + 1e-6)`` (total variation to the one-hot target).
* ``lk-lambda``: ``kappa CE + (1 - kappa) TV`` of the two above, ``kappa = kl_scale exp(-kl_decay
  mean alpha)`` detached, the mean taken over every supervised position of the micro-batch (one value
  per micro-batch and rank: no collective, and the same for any row layout of the same documents).

The weights that span a block (D-PACE's prefix products and suffix sums) only need that block's own
positions, so they are computed inside each chunk of :func:`~lightning_drafts.core.chunked_terms.
over_chunks` from the chunk's logits; the weights that span documents or the micro-batch need only
supervision bits (known before any logits) or a scalar (``kappa``'s mean, combined after every chunk).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_drafts.attention.block_masks import BlockLayout
from lightning_drafts.blockdraft.objective import LOSS_EPS
from lightning_drafts.core.batch import PackedBatch
from lightning_drafts.core.checks import is_number

DPACE_LOSS_TYPES = ("dpace", "dpace-cumulative-confidence-only", "dpace-continuation-value-only")
LK_LOSS_TYPES = ("lk-alpha", "lk-tv", "lk-lambda")
LOSS_TYPES = ("dflash", *DPACE_LOSS_TYPES, *LK_LOSS_TYPES)


@dataclass(frozen=True)
class ChunkTerms:
    """One chunk's vocabulary terms: the differentiable loss sums (:attr:`BlockObjective.num_terms`), the
    per-position weights the loss used (``[m, D]``, for DFlash2's selector) and the detached sum of ``p``
    over supervised positions (``lk-lambda``'s mean acceptance)."""

    sums: tuple[Tensor, ...]
    weights: Tensor
    gold_probability_sum: Tensor


@dataclass(frozen=True)
class BlockObjective:
    """The loss of one micro-batch of blocks (see the module docstring for the formulas)."""

    loss_type: str = "dflash"
    dpace_alpha: float = 0.5
    kl_scale: float = 1.0
    kl_decay: float = 1.0

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type {self.loss_type!r} is unknown; choose one of {LOSS_TYPES}")
        _check_in_unit_interval("dpace_alpha", self.dpace_alpha)
        # kappa <= kl_scale, so a scale in [0, 1] keeps TV's coefficient 1 - kappa non-negative; above 1
        # it would reward a lower acceptance early in training.
        _check_in_unit_interval("kl_scale", self.kl_scale)
        if not is_number(self.kl_decay) or not 0 <= self.kl_decay < math.inf:
            raise ValueError(f"kl_decay = {self.kl_decay!r} must be a finite number >= 0")

    @property
    def is_dpace(self) -> bool:
        return self.loss_type in DPACE_LOSS_TYPES

    @property
    def num_terms(self) -> int:
        """Differentiable sums per chunk: ``lk-lambda`` mixes CE and TV with a weight known only after the
        last chunk, so each keeps its own gradient; every other objective has one."""
        return 2 if self.loss_type == "lk-lambda" else 1

    def base_weights(
        self, packed: PackedBatch, layout: BlockLayout, valid: Tensor, decay: Tensor
    ) -> tuple[Tensor, Tensor]:
        """``[M, D]`` weights known before any logits, and the loss denominator.

        D-PACE: ``v / A_doc`` (its logit-dependent factor is applied per chunk) over the number of
        documents; otherwise ``d v`` over ``sum d v + 1e-6``.
        """
        if self.is_dpace:
            scale, documents = document_block_scale(packed, layout, valid)
            return valid * scale[:, None], documents.float().clamp(min=1.0)
        weights = decay * valid
        return weights, weights.sum() + LOSS_EPS

    def chunk_terms(self, nll: Tensor, valid: Tensor, base: Tensor) -> ChunkTerms:
        """The loss terms of a chunk of whole blocks from its fp32 cross-entropies ``nll [m, D]``
        (:func:`~lightning_drafts.core.gold_nll.nll_and_argmax`); any finite value stands where not
        ``valid``: it only meets zero weights."""
        gold = torch.exp(-nll)
        weights = base
        if self.is_dpace:
            weights = base * dpace_weights(gold.detach(), valid, self.dpace_alpha, self.loss_type)
        if self.loss_type == "lk-tv":
            sums: tuple[Tensor, ...] = (((1.0 - gold) * weights).sum(),)
        elif self.loss_type == "lk-lambda":
            sums = ((nll * weights).sum(), ((1.0 - gold) * weights).sum())
        else:
            sums = ((nll * weights).sum(),)
        return ChunkTerms(sums, weights, (gold.detach() * valid).sum())

    def loss(
        self, sums: tuple[Tensor, ...], gold_probability_sum: Tensor, supervised: Tensor, denominator: Tensor
    ) -> Tensor:
        """The micro-batch loss from the chunk sums (summed over chunks) and the denominator."""
        if self.loss_type != "lk-lambda":
            return sums[0] / denominator
        kappa = self.kl_weight(gold_probability_sum, supervised)
        cross_entropy, total_variation = sums
        return (kappa * cross_entropy + (1.0 - kappa) * total_variation) / denominator

    def kl_weight(self, gold_probability_sum: Tensor, supervised: Tensor) -> Tensor:
        """``lk-lambda``'s ``kappa = kl_scale exp(-kl_decay mean alpha)`` over the micro-batch (detached)."""
        mean = gold_probability_sum.detach() / supervised.float().clamp(min=1.0)
        return self.kl_scale * torch.exp(-self.kl_decay * mean)


def dpace_weights(gold: Tensor, valid: Tensor, alpha: float, loss_type: str) -> Tensor:
    """D-PACE's per-position weights ``[M, D]`` of each block from the gold-token probabilities."""
    smooth = torch.where(valid, (1.0 - alpha) * gold + alpha, torch.ones_like(gold))
    prefix = smooth.cumprod(dim=-1)
    if loss_type == "dpace-cumulative-confidence-only":
        return prefix * valid
    suffix = (prefix * valid).flip(-1).cumsum(-1).flip(-1)
    if loss_type == "dpace":
        return suffix * valid
    if loss_type == "dpace-continuation-value-only":
        # A tiny floor instead of a zero: with dpace_alpha = 0 a prefix can underflow.
        return suffix / prefix.clamp(min=torch.finfo(prefix.dtype).tiny) * valid
    raise ValueError(f"loss_type {loss_type!r} is not a D-PACE objective; choose one of {DPACE_LOSS_TYPES}")


def document_block_scale(packed: PackedBatch, layout: BlockLayout, valid: Tensor) -> tuple[Tensor, Tensor]:
    """Per block ``1 / A_doc`` (0 for a block without a supervised position) and the number of documents
    with ``A_doc > 0``.

    A document is keyed by its row and start, which names it in any layout, so documents that share a
    row are counted apart.
    """
    supervised = valid.any(dim=-1).float()
    document = layout.rows * layout.width + packed.doc_start[layout.rows, layout.anchors]
    keys, index = torch.unique(document, return_inverse=True)
    counts = torch.zeros(keys.numel(), device=valid.device)
    counts.scatter_add_(0, index, supervised)
    return supervised / counts[index].clamp(min=1.0), (counts > 0).sum()


def _check_in_unit_interval(name: str, value: object) -> None:
    if not is_number(value) or not 0 <= value <= 1:
        raise ValueError(f"{name} = {value!r} must be a number in [0, 1]")
