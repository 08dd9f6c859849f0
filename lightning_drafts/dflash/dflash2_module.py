"""DFlash2Module: DFlash plus an in-block convolution and a pairwise path selector.

Checkpoints of earlier releases record it as ``lightning_drafts.dflash.module.DFlash2Module``, where it
was defined beside DFlashModule; they load as this class.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from lightning_drafts.attention.block_masks import BlockLayout
from lightning_drafts.blockdraft.conv import CONV_KERNEL_SIZE
from lightning_drafts.blockdraft.objective import (
    LOSS_EPS,
    BlockTargets,
    chain_hidden,
)
from lightning_drafts.core.acceptance import acceptance_length, prefix_counts, skip_holes_accept_sums
from lightning_drafts.core.batch import PackedBatch
from lightning_drafts.core.draft_output import DraftOutput
from lightning_drafts.core.gold_nll import nll_and_argmax
from lightning_drafts.core.ratio_metric import ratio
from lightning_drafts.dflash.candidate_logits import candidate_logits
from lightning_drafts.dflash.draft import DFlash2Draft
from lightning_drafts.dflash.module import DFlashModule
from lightning_drafts.dflash.path_selector import selector_cross_entropy
from lightning_drafts.dflash.rules import SELECTOR_TOP_K
from lightning_drafts.training.target import TargetSpec


class DFlash2Module(DFlashModule):
    """DFlash2 (docs/concepts/dflash.md#dflash2): DFlash plus an in-block two-tap convolution around every
    sublayer and a pairwise path selector over each slot's top-``selector_top_k`` candidates.

    ``variable_prefix`` is not supported. ``correct`` is the selector's teacher-forced pick; ``metrics``
    add ``candidate_recall``, ``greedy_accept_len`` (the real greedy selector walk), ``base_accept_len``
    (backbone argmax), ``base_loss`` (the ``loss_type`` objective) and ``selector_loss`` (weighted by the
    objective's per-position weights, over their own sum).

    Args:
        num_anchors: blocks per **document** and micro-batch (256 for DFlash2).
        conv_kernel_size: taps of the in-block convolution around every sublayer (2; identity at init).
        conv_group_size: channels per convolution group (16); must divide the hidden size.
        selector_rank: rank of the pairwise path selector (256).
        selector_top_k: candidates per slot the selector scores (16), at most the vocabulary.
        selector_loss_weight: the selector loss's weight λ (1.0), >= 0.
        **dflash_kwargs: every :class:`DFlashModule` argument.
    """

    former_class_paths = ("lightning_drafts.dflash.module.DFlash2Module",)

    architecture = "DFlash2DraftModel"

    def __init__(
        self,
        target: TargetSpec,
        mask_token_id: int | None = None,
        num_anchors: int = 256,
        conv_kernel_size: int = 2,
        conv_group_size: int = 16,
        selector_rank: int = 256,
        selector_top_k: int = 16,
        selector_loss_weight: float = 1.0,
        **dflash_kwargs: Any,
    ) -> None:
        if dflash_kwargs.get("variable_prefix"):
            raise ValueError(
                "DFlash2 does not support variable_prefix (its selector assumes a one-token prefix)"
            )
        if not selector_loss_weight >= 0:
            raise ValueError(f"selector_loss_weight = {selector_loss_weight!r} must be >= 0")
        CONV_KERNEL_SIZE.check(conv_kernel_size, block_size=dflash_kwargs.get("block_size", 16))
        self._conv = (conv_kernel_size, conv_group_size)
        self._selector_rank = selector_rank
        super().__init__(target=target, mask_token_id=mask_token_id, num_anchors=num_anchors, **dflash_kwargs)
        SELECTOR_TOP_K.check(selector_top_k, vocab_size=self.target.vocab_size)
        self.selector_top_k = selector_top_k
        self.selector_loss_weight = selector_loss_weight

    def _build_draft(self, config: Any) -> DFlash2Draft:
        kernel, group = self._conv
        return DFlash2Draft(config, len(self.target_layer_ids), kernel, group, self._selector_rank)

    def _ratio_names(self) -> tuple[str, ...]:
        return (*super()._ratio_names(), "candidate_recall")

    def _metric_names(self) -> tuple[str, ...]:
        return (
            *super()._metric_names(),
            "greedy_accept_len",
            "base_accept_len",
            "base_loss",
            "selector_loss",
        )

    def _objective(
        self, packed: PackedBatch, layout: BlockLayout, hidden: Tensor, targets: BlockTargets
    ) -> DraftOutput:
        base, denominator = self._base_weights(packed, layout, targets)
        # Teacher forcing: chain j follows the gold token at anchor + j (the anchor itself for j = 0).
        predecessors = packed.input_ids[layout.rows[:, None], layout.block_row_positions()[:, :-1]]
        terms = self.objective.num_terms
        outputs = self._over_chunks(
            self._chunk_terms,
            chain_hidden(hidden, targets),
            targets.labels,
            targets.valid,
            base,
            predecessors,
            self._chain_counts(targets.valid),
            differentiable=terms + 1,
        )
        sums = tuple(outputs[:terms])
        selector_sum, gold_sum, predicted, selector_weight, covered, picks, walk = outputs[terms:]
        labels, valid = targets.labels, targets.valid
        base_loss = self.objective.loss(sums, gold_sum, valid.sum(), denominator)
        selector_loss = selector_sum / (selector_weight + LOSS_EPS)
        correct = (picks == labels) & valid
        recall = ((covered & valid).sum().float(), valid.sum().float())
        metrics = {
            "candidate_recall": ratio(*recall),
            "greedy_accept_len": _accept_len((walk == labels) & valid, valid),
            "base_accept_len": _accept_len((predicted == labels) & valid, valid),
            "base_loss": base_loss.detach(),
            "selector_loss": selector_loss.detach(),
        }
        return DraftOutput(
            loss=base_loss + self.selector_loss_weight * selector_loss,
            correct=correct,
            valid=valid,
            metrics={k: v.float() for k, v in metrics.items()},
            sums={
                "candidate_recall": recall,
                "accept_len_skip_holes": skip_holes_accept_sums(correct, valid),
            },
        )

    def _chunk_terms(
        self,
        states: Tensor,
        labels: Tensor,
        valid: Tensor,
        base: Tensor,
        predecessors: Tensor,
        counts: Tensor,
    ) -> tuple[Tensor, ...]:
        positions = self._positions(valid, counts)
        kept_states, kept_labels = positions.gather(states), positions.gather(labels)
        logits = self._logits(kept_states)
        nll, predicted = nll_and_argmax(logits, kept_labels, self._single_nll_backward)
        terms = self.objective.chunk_terms(positions.scatter(nll), valid, base)
        selector = self.draft.candidate_selector
        unary, candidates = self._candidate_logits(kept_states, logits)
        scores = selector.scores(kept_states, unary, candidates, positions.gather(predecessors))
        # The selector follows the objective's weights (D-PACE's included), normalised by their own sum.
        selector_sum, selector_weight, covered = selector_cross_entropy(
            scores, candidates, kept_labels, positions.gather(terms.weights)
        )
        picks = candidates.gather(-1, scores.argmax(-1, keepdim=True)).squeeze(-1)
        # The walk's statistic reads each chain's leading run of supervised positions only, and a step of
        # that run follows earlier steps of it: what stands at a position left out is never read there.
        walk = selector.greedy_walk(
            states.detach(),
            positions.scatter(unary.detach()),
            positions.scatter(candidates),
            predecessors[:, 0],
        )
        # -1 is never a label: a position left out is never correct.
        return (
            *terms.sums,
            selector_sum,
            terms.gold_probability_sum,
            positions.scatter(predicted, -1),
            selector_weight.detach(),
            positions.scatter(covered, False),
            positions.scatter(picks, -1),
            walk,
        )

    def _candidate_logits(self, states: Tensor, logits: Tensor) -> tuple[Tensor, Tensor]:
        """The top-``selector_top_k`` logits ``[n, K]`` of ``logits [n, V]`` (from the states ``[n, H]``) and
        their ids, differentiable through only those K rows of the LM head
        (:func:`~lightning_drafts.dflash.candidate_logits.candidate_logits`)."""
        return candidate_logits(logits, states, self.target.lm_head.weight, self.selector_top_k)

    def _head_parameters(self) -> list[Tensor]:
        return [p for p in self.draft.candidate_selector.parameters() if p.requires_grad]

    def dflash_config(self) -> dict[str, Any]:
        kernel, group = self._conv
        return {
            **super().dflash_config(),
            "conv_kernel_size": kernel,
            "conv_group_size": group,
            "selector_rank": self._selector_rank,
            "selector_top_k": self.selector_top_k,
        }


def _accept_len(correct: Tensor, valid: Tensor) -> Tensor:
    return acceptance_length(*prefix_counts(correct, valid))
