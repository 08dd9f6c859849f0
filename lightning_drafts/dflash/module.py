"""DFlashModule: block-parallel drafts trained with exact sequence packing (DFlash2 builds on it:
:mod:`lightning_drafts.dflash.dflash2_module`).

One micro-batch: the frozen target captures ``target_layer_ids`` over every row (documents isolated)
-> anchors (per document, whole blocks inside their document) -> all blocks of the micro-batch laid
out back to back over the real tokens -> one document-aware block mask shared by every layer -> the
draft fills each block -> block targets and the ``loss_type`` objective. Packed and padded batches take
the same path and, given the same anchors, give the same loss, gradients and acceptance statistics.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_drafts.attention.anchors import check_anchors, documents_shorter_than, sample_anchors
from lightning_drafts.attention.block_masks import (
    BLOCK_BACKENDS,
    SLIDING_WINDOW,
    BlockLayout,
    block_layout,
    build_block_mask,
    resolve_block_backend,
)
from lightning_drafts.blockdraft.draft import default_target_layer_ids, draft_config
from lightning_drafts.blockdraft.objective import (
    BlockTargets,
    block_targets,
    chain_hidden,
    check_prefix_lengths,
    decay_weights,
    sample_prefix_lengths,
)
from lightning_drafts.core.acceptance import skip_holes_accept_sums
from lightning_drafts.core.batch import PackedBatch
from lightning_drafts.core.chain_positions import ChainPositions, supervised_per_chain
from lightning_drafts.core.checks import check_bool, check_int
from lightning_drafts.core.chunked_terms import over_chunks
from lightning_drafts.core.draft_output import DraftOutput
from lightning_drafts.core.gold_nll import nll_and_argmax
from lightning_drafts.core.target_features import FeatureRequest
from lightning_drafts.dflash.draft import DFlashDraft
from lightning_drafts.dflash.export import export_draft
from lightning_drafts.dflash.objectives import BlockObjective
from lightning_drafts.dflash.reload import load_into_module
from lightning_drafts.dflash.rules import BLOCK_SIZE, TARGET_LAYER_IDS
from lightning_drafts.training.hyperparameters import check_mask_token_against_data, check_mask_token_id
from lightning_drafts.training.module import DraftModule
from lightning_drafts.training.target import TargetSpec

DRAFT_BACKENDS = BLOCK_BACKENDS


class DFlashModule(DraftModule):
    """DFlash (docs/concepts/dflash.md#the-draft): a non-causal draft that fills a block of ``block_size``
    tokens at once.

    Args:
        target: hub id / local path, config dict (random tiny target) or ``PreTrainedModel``.
        mask_token_id: the reserved id whose (frozen target) embedding marks slots to predict. Required:
            never pad / eos, and the same id at serving time.
        target_layer_ids: target layers whose outputs (HF ``hidden_states[id + 1]``) are fused, in this
            order (the order is part of the checkpoint). Default: the DFlash spread over the target.
        num_draft_layers: draft decoder layers (5 in the paper).
        block_size: slots per block: the anchor and ``block_size - 1`` drafted tokens.
        num_anchors: blocks per **document** and micro-batch (fewer when a document has fewer anchors).
        loss_decay_gamma: decay ``exp(-j / gamma)`` over chain positions; None = uniform. 7 suits block
            size 16 (5 for 10, 4 for 8).
        sliding_window: optional context window of every draft layer (in-block attention is untouched).
        variable_prefix: the D2SD variable-prefix objective (random known prefix per block).
        prefix_weight_base: ``P(prefix = l) ∝ base ** l`` under ``variable_prefix``.
        loss_type: the objective (:mod:`lightning_drafts.dflash.objectives`): ``"dflash"`` (decay-weighted
            cross-entropy), D-PACE ``"dpace"`` / ``"dpace-cumulative-confidence-only"`` /
            ``"dpace-continuation-value-only"`` (replace the decay with detached acceptance weights), or
            LK ``"lk-alpha"`` / ``"lk-tv"`` / ``"lk-lambda"`` (decay-weighted).
        dpace_alpha: D-PACE's confidence smoothing ``s = (1 - a) p + a``, in [0, 1] (0.5).
        kl_scale, kl_decay: ``lk-lambda``'s CE weight ``kl_scale * exp(-kl_decay * mean acceptance)``;
            ``kl_scale`` in [0, 1] (1.0), ``kl_decay`` >= 0 (1.0).
        draft_attn_backend: ``"auto"`` (flex on CUDA, else SDPA), ``"sdpa"``, ``"eager"`` or ``"flex"``.
        draft_overrides: optional draft ``num_attention_heads`` / ``num_key_value_heads`` / ``head_dim`` /
            ``intermediate_size`` (the hidden size always equals the target's).
        draft_seed: seed of the draft's initial weights.
        logits_chunk_blocks: blocks whose logits exist at once. Each chunk's loss is differentiated as
            soon as it is computed and its logits freed (nothing recomputed), so ``[M, block_size - 1, V]``
            logits never exist whole; None computes them in one piece under plain autograd.
        block_valid_only: draft only the blocks with a supervised chain position, and project only the
            supervised chain positions onto the vocabulary (:mod:`lightning_drafts.core.chain_positions`):
            the same loss, gradients and statistics. ``False`` drafts every block and computes logits at
            every chain position: the reference the tests compare with.
        **base_kwargs: :class:`~lightning_drafts.training.module.DraftModule` arguments (target backend / dtype /
            seed, optimiser, schedule, FSDP options). Learning rate 6e-4 and warmup 0.04 by default.
    """

    architecture = "DFlashDraftModel"

    def __init__(
        self,
        target: TargetSpec,
        mask_token_id: int | None = None,
        target_layer_ids: Sequence[int] | None = None,
        num_draft_layers: int = 5,
        block_size: int = 16,
        num_anchors: int = 512,
        loss_decay_gamma: float | None = 7.0,
        sliding_window: int | None = None,
        variable_prefix: bool = False,
        prefix_weight_base: float = 0.9,
        loss_type: str = "dflash",
        dpace_alpha: float = 0.5,
        kl_scale: float = 1.0,
        kl_decay: float = 1.0,
        draft_attn_backend: str = "auto",
        draft_overrides: dict[str, int] | None = None,
        draft_seed: int = 0,
        logits_chunk_blocks: int | None = 128,
        block_valid_only: bool = True,
        learning_rate: float = 6e-4,
        warmup_ratio: float = 0.04,
        **base_kwargs: Any,
    ) -> None:
        check_bool("block_valid_only", block_valid_only)
        # Before the target loads: a misspelt objective should not cost a model download.
        self.objective = BlockObjective(loss_type, dpace_alpha, kl_scale, kl_decay)
        # In the signature, not set by default inside: the CLI reads defaults from signatures and would
        # otherwise pass the base class's.
        super().__init__(target=target, learning_rate=learning_rate, warmup_ratio=warmup_ratio, **base_kwargs)
        check_int("num_draft_layers", num_draft_layers, 1)
        check_int("num_anchors", num_anchors, 1)
        BLOCK_SIZE.check(block_size)
        self.mask_token_id = check_mask_token_id(mask_token_id, self.target, self.hparams.get("pad_token_id"))
        if loss_decay_gamma is not None and not loss_decay_gamma > 0:
            raise ValueError(
                f"loss_decay_gamma = {loss_decay_gamma!r} must be > 0, or None for uniform weights"
            )
        if sliding_window is not None:
            SLIDING_WINDOW.check(sliding_window)
        if not prefix_weight_base > 0:
            raise ValueError(f"prefix_weight_base = {prefix_weight_base!r} must be > 0")
        if logits_chunk_blocks is not None:
            check_int("logits_chunk_blocks", logits_chunk_blocks, 1)
        if draft_attn_backend not in DRAFT_BACKENDS:
            raise ValueError(
                f"draft_attn_backend {draft_attn_backend!r} is unknown; choose one of {DRAFT_BACKENDS}"
            )
        num_target_layers = self.target.num_layers
        if target_layer_ids is None:
            target_layer_ids = default_target_layer_ids(num_target_layers, num_draft_layers)
        self.target_layer_ids = TARGET_LAYER_IDS.check(list(target_layer_ids), num_layers=num_target_layers)
        self.block_size = block_size
        self.num_anchors = num_anchors
        self.loss_decay_gamma = loss_decay_gamma
        self.sliding_window = sliding_window
        self.variable_prefix = variable_prefix
        self.prefix_weight_base = prefix_weight_base
        self.draft_attn_backend = draft_attn_backend
        self.logits_chunk_blocks = logits_chunk_blocks
        config = draft_config(self.target.text_config, num_draft_layers, sliding_window, draft_overrides)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(draft_seed)
            self.draft = self._build_draft(config)
        self.register_ratio_metrics(self._ratio_names())

    def _build_draft(self, config: Any) -> DFlashDraft:
        return DFlashDraft(config, len(self.target_layer_ids))

    # --- anchors and the objective ---------------------------------------------------------------

    def check_data(self, datamodule: Any) -> None:
        check_mask_token_against_data(self.mask_token_id, datamodule)

    def sample_anchors(
        self, batch: Mapping[str, Tensor] | PackedBatch, generator: torch.Generator | None = None
    ) -> Tensor:
        """``[B, N]`` anchors (row positions, -1 = none): ``min(num_anchors, valid anchors)`` per document."""
        return sample_anchors(self.prepare_batch(batch), self.block_size, self.num_anchors, generator)

    def compute_loss(
        self,
        batch: Mapping[str, Tensor] | PackedBatch,
        anchors: Tensor | None = None,
        prefix_lengths: Tensor | None = None,
    ) -> DraftOutput:
        """The objective on one micro-batch; deterministic given ``anchors`` (and, under
        ``variable_prefix``, ``prefix_lengths`` ``[B, N]`` aligned with them)."""
        packed = self.prepare_batch(batch)
        if anchors is None:
            anchors = self.sample_anchors(packed, self.draws)
        else:
            anchors = check_anchors(packed, anchors, self.block_size)
        layout = block_layout(packed, anchors, self.block_size)
        short = documents_shorter_than(packed, self.block_size)
        known = self._known_slots(layout, anchors, prefix_lengths)
        if layout.num_blocks == 0:
            return self._empty_output(short)
        targets = block_targets(packed, layout, known)
        kept = self._kept_blocks(targets.valid)
        if kept is None:
            hidden = self._draft_hidden(packed, layout, known, self._needed_slots(targets))
            output = self._objective(packed, layout, hidden, targets)
        else:
            drafted, kept_targets = layout.select(kept), targets.select(kept)
            hidden = self._draft_hidden(packed, drafted, known[kept], self._needed_slots(kept_targets))
            output = self._objective(packed, drafted, hidden, kept_targets).among_chains(kept)
        blocks = torch.tensor(float(layout.num_blocks), device=short.device)
        output.metrics.update(blocks=blocks, short_documents=short.float())
        return output

    def _kept_blocks(self, valid: Tensor) -> Tensor | None:
        """The blocks to draft (bool ``[M]``; None: every one). A block without a supervised chain position
        adds nothing to the loss, a gradient or a statistic, and no other block attends to it. When no
        block has one, the first stays: the loss is then the graph-connected zero the full step gives."""
        if not self.hparams.block_valid_only:
            return None
        kept = valid.any(dim=1)
        if bool(kept.all()):
            return None
        if not bool(kept.any()):
            kept[0] = True
        return kept

    @property
    def _single_nll_backward(self) -> bool:
        """One loss term reads the cross-entropy (``lk-lambda``'s two each differentiate it; DFlash2's
        selector reads the logits only detached), so one backward runs through it."""
        return self.objective.num_terms == 1

    def _positions(self, valid: Tensor, counts: Tensor) -> ChainPositions:
        """The chain positions whose vocabulary terms are computed (all unless ``block_valid_only``) in a
        chunk of chains, and ``counts`` its slice of :meth:`_chain_counts`."""
        supervised_only = self.hparams.block_valid_only
        return ChainPositions.of(valid, supervised_only, int(counts.sum()) if supervised_only else None)

    def _chain_counts(self, valid: Tensor) -> Tensor:
        """Per chain, what :meth:`_positions` reads to size a chunk's index: the supervised positions on
        the host (one read of the device for every chunk) when only those are computed, else unread."""
        return supervised_per_chain(valid) if self.hparams.block_valid_only else valid[:, 0]

    def _known_slots(self, layout: BlockLayout, anchors: Tensor, prefix_lengths: Tensor | None) -> Tensor:
        """How many leading slots of each block hold real tokens: 1 (the anchor), or the variable prefix."""
        if not self.variable_prefix:
            if prefix_lengths is not None:
                raise ValueError(
                    "prefix_lengths were given but variable_prefix is off; drop them or enable it"
                )
            return torch.ones_like(layout.anchors)
        if prefix_lengths is None:
            if layout.num_blocks == 0:
                return torch.ones_like(layout.anchors)
            return sample_prefix_lengths(
                layout.num_blocks,
                self.block_size,
                self.prefix_weight_base,
                generator=self.draws,
                device=layout.anchors.device,
            )
        return check_prefix_lengths(prefix_lengths, anchors, self.block_size)[layout.rows, layout.slots]

    def _needed_slots(self, targets: BlockTargets) -> Tensor | None:
        """Bool ``[M, bs]``: the slots that predict a supervised chain position, whose states the objective
        reads (None: every slot, the reference path). DFlash2's greedy walk also reads the others, but only
        at positions its statistic never reads (see :meth:`DFlash2Module._chunk_terms`)."""
        if not self.hparams.block_valid_only:
            return None
        blocks = targets.valid.shape[0]
        # Summed, not written: a chain past its block is clamped onto the last slot, whose own chain may count.
        hits = torch.zeros(blocks, self.block_size, dtype=torch.long, device=targets.valid.device)
        return hits.scatter_add_(1, targets.slots, targets.valid.long()) > 0

    def _draft_hidden(
        self, packed: PackedBatch, layout: BlockLayout, known: Tensor, needed: Tensor | None = None
    ) -> Tensor:
        captured = self.target_output(packed, self.target_layer_ids, final=False).hidden_states
        features = layout.gather_context(torch.cat(captured, dim=-1))
        tokens = layout.block_input_ids(packed.input_ids, self.mask_token_id, known)
        backend = self._draft_backend(packed.input_ids.device)
        mask = build_block_mask(layout, backend, self.sliding_window)
        return self.draft(
            features,
            layout.gather_context(packed.position_ids),
            self.target.input_embeddings(tokens),
            layout.block_position_ids(packed.position_ids),
            mask,
            needed,
        )

    def feature_request(self) -> FeatureRequest:
        """The fused layers at every token; no teacher (block targets are the data's tokens)."""
        return FeatureRequest(tuple(self.target_layer_ids), "none")

    def _draft_backend(self, device: torch.device) -> str:
        return resolve_block_backend(self.draft_attn_backend, device)

    def _logits(self, hidden: Tensor) -> Tensor:
        head = self.target.lm_head
        return torch.nn.functional.linear(hidden.to(head.weight.dtype), head.weight, head.bias)

    def _objective(
        self, packed: PackedBatch, layout: BlockLayout, hidden: Tensor, targets: BlockTargets
    ) -> DraftOutput:
        base, denominator = self._base_weights(packed, layout, targets)
        *sums, gold_sum, predicted = self._over_chunks(
            self._chunk_terms,
            chain_hidden(hidden, targets),
            targets.labels,
            targets.valid,
            base,
            self._chain_counts(targets.valid),
            differentiable=self.objective.num_terms,
        )
        correct = (predicted == targets.labels) & targets.valid
        return DraftOutput(
            loss=self.objective.loss(tuple(sums), gold_sum, targets.valid.sum(), denominator),
            correct=correct,
            valid=targets.valid,
            sums={"accept_len_skip_holes": skip_holes_accept_sums(correct, targets.valid)},
        )

    def _chunk_terms(
        self, states: Tensor, labels: Tensor, valid: Tensor, base: Tensor, counts: Tensor
    ) -> tuple[Tensor, ...]:
        positions = self._positions(valid, counts)
        logits = self._logits(positions.gather(states))
        nll, predicted = nll_and_argmax(
            logits, positions.gather(labels), self._single_nll_backward, consume=True
        )
        terms = self.objective.chunk_terms(positions.scatter(nll), valid, base)
        # -1 is never a label: a position left out is never correct.
        return (*terms.sums, terms.gold_probability_sum, positions.scatter(predicted, -1))

    def _over_chunks(
        self, terms: Callable[..., tuple[Tensor, ...]], *per_block: Tensor, differentiable: int = 1
    ) -> list[Tensor]:
        """Run ``terms`` on chunks of ``logits_chunk_blocks`` blocks: scalar outputs are summed, per-block
        outputs concatenated. Each chunk's backward runs as soon as its logits exist, which are then freed."""
        return over_chunks(
            terms, self.logits_chunk_blocks, per_block, self._head_parameters(), differentiable
        )

    def _head_parameters(self) -> list[Tensor]:
        """The trainable weights the vocabulary terms read: none (the target's LM head is frozen)."""
        return []

    def _base_weights(
        self, packed: PackedBatch, layout: BlockLayout, targets: BlockTargets
    ) -> tuple[Tensor, Tensor]:
        """The objective's logit-free weights ``[M, D]`` and its loss denominator."""
        decay = decay_weights(targets.labels.shape[1], self.loss_decay_gamma, targets.labels.device)
        return self.objective.base_weights(packed, layout, targets.valid, decay)

    def _empty_output(self, short: Tensor) -> DraftOutput:
        """No anchor anywhere: a zero loss still connected to every trainable parameter, so each rank
        runs backward and DDP / FSDP stay in lockstep."""
        trainable = [p for p in self.draft.parameters() if p.requires_grad]
        loss = torch.stack([p.sum() for p in trainable]).sum() * 0.0
        empty = torch.zeros(0, self.block_size - 1, dtype=torch.bool, device=loss.device)
        zero = torch.zeros((), device=loss.device)
        metrics = {name: zero for name in self._metric_names()}
        metrics["short_documents"] = short.float()
        sums = {name: (zero, zero) for name in self._ratio_names()}
        return DraftOutput(loss=loss, correct=empty, valid=empty.clone(), metrics=metrics, sums=sums)

    def _metric_names(self) -> tuple[str, ...]:
        return ("blocks", "short_documents", *self._ratio_names())

    def _ratio_names(self) -> tuple[str, ...]:
        """The metrics logged as exact ratios of sums (``DraftOutput.sums``)."""
        return ("accept_len_skip_holes",)

    # --- serving export ----------------------------------------------------------------------------

    def export(self, output_dir: str | Path) -> Path:
        """Write ``config.json`` + ``model.safetensors`` in the layout vLLM's ``dflash`` and SGLang load
        (``lightning-drafts export`` validates it against the target before it lands)."""
        return export_draft(
            self.draft,
            Path(output_dir),
            self.dflash_config(),
            self.architecture,
            self.target.num_layers,
            self.target_record(),
        )

    def load_exported(self, path: str | Path) -> None:
        """Load exported draft weights into this module (the export's dflash_config must match)."""
        load_into_module(self.draft, Path(path), self.architecture, self.dflash_config())

    def dflash_config(self) -> dict[str, Any]:
        """The ``dflash_config`` block of the exported config (what serving engines read)."""
        return {
            "block_size": self.block_size,
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids),
        }
