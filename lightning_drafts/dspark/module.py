"""DSparkModule: DSpark draft training (docs/concepts/dspark.md) with exact sequence packing.

One micro-batch: the frozen target captures ``target_layer_ids`` and its final-norm states over every
row (documents isolated) -> anchors (per document; the anchor and the next token supervised and in one
document) -> all blocks of the micro-batch laid out back to back over the real tokens with the shared
document-aware block mask -> the DFlash backbone fills each block (slot 0 = anchor token, the rest
``mask_token_id``) -> Markov-corrected logits and confidence logits -> block supervision truncated at
the document end -> the three-term loss. Packed and padded batches take the same path and, given the
same anchors, give the same loss, gradients and statistics.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_drafts.attention.anchors import check_anchors, sample_anchors
from lightning_drafts.attention.block_masks import (
    BLOCK_BACKENDS,
    BlockLayout,
    block_layout,
    build_block_mask,
    resolve_block_backend,
)
from lightning_drafts.blockdraft.draft import draft_config
from lightning_drafts.core.batch import PackedBatch
from lightning_drafts.core.chain_positions import ChainPositions
from lightning_drafts.core.checks import check_bool, check_int, is_number
from lightning_drafts.core.chunked_terms import chunk_bounds, over_chunks
from lightning_drafts.core.draft_output import DraftOutput
from lightning_drafts.core.ratio_metric import Sums, ratio
from lightning_drafts.core.sized_unique import first_seen_per_chain, sorted_unique
from lightning_drafts.core.target_features import FeatureRequest
from lightning_drafts.dspark.context_features import (
    check_target_layer_ids,
    context_features,
    default_target_layer_ids,
    hooked_layer_ids,
)
from lightning_drafts.dspark.draft import DSparkDraft
from lightning_drafts.dspark.eval_mask import BlockSupervision, block_supervision
from lightning_drafts.dspark.export import export_draft
from lightning_drafts.dspark.metrics import acceptance_sums, confidence_sums
from lightning_drafts.dspark.objective import (
    LOSS_EPS,
    LossWeights,
    acceptance_probability,
    confidence_bce,
    decay_weights,
    distribution_terms,
    normalise,
)
from lightning_drafts.dspark.reload import load_into_module
from lightning_drafts.dspark.rules import (
    BLOCK_SIZE,
    CONFIDENCE_HEAD_WITH_MARKOV,
    MARKOV_HEAD_TYPE,
    MARKOV_RANK,
)
from lightning_drafts.training.hyperparameters import check_mask_token_against_data, check_mask_token_id
from lightning_drafts.training.module import DraftModule
from lightning_drafts.training.target import TargetSpec

LOSS_TERMS = ("ce_loss", "tv_loss", "confidence_loss")


class DSparkModule(DraftModule):
    """DSpark (docs/concepts/dspark.md): a DFlash-style block drafter whose slot k predicts the token at
    ``anchor + k + 1``, plus a Markov head (low-rank bigram bias from the previous token) and a confidence
    head.

    Args:
        target: hub id / local path, config dict (random tiny target) or ``PreTrainedModel``.
        mask_token_id: the reserved id of slots 1..K-1 (required; never pad / eos; the same id at serving).
        target_layer_ids: strictly increasing feature ids in ``[-1, L - 1]`` (-1 = embedding output,
            L - 1 = final-norm output, else decoder-layer outputs); default NeMo's spread
            ``round(1 + i (L - 2) / (n - 1))`` over ``num_draft_layers`` ids.
        num_draft_layers: draft decoder layers (NeMo's ``draft_num_hidden_layers``, 5).
        block_size: K slots per block = K proposals per block (7).
        num_anchors: blocks per **document** and micro-batch (512; fewer when a document has fewer anchors).
        markov_rank: rank of the Markov head (256); 0 = none.
        markov_head_type: ``"vanilla"`` (default), ``"gated"`` or ``"rnn"``.
        confidence_head_alpha: confidence loss weight (1.0); > 0 builds the confidence head.
        confidence_head_with_markov: the confidence head also reads the Markov latent (True).
        ce_loss_alpha, l1_loss_alpha: weights of the ``ce`` and ``tv`` terms (0.1, 0.9).
        loss_decay_gamma: slot weight ``exp(-k / gamma)`` (0-based k); 4.0 as the shipped recipe; None =
            uniform (NeMo's bare code default).
        freeze_embeddings: keep the draft's embedding / LM head copies frozen (True).
        draft_attn_backend: ``"auto"`` (flex on CUDA, else SDPA), ``"sdpa"``, ``"eager"`` or ``"flex"``.
        draft_overrides: optional draft ``num_attention_heads`` / ``num_key_value_heads`` / ``head_dim`` /
            ``intermediate_size``.
        draft_seed: seed of the draft's initial weights.
        logits_chunk_blocks: blocks whose ``[blocks, K, V]`` logits exist at once (each chunk is
            differentiated as soon as it is computed, nothing recomputed); None = one piece.
        block_valid_only: compute the vocabulary terms (draft and teacher logits, ce, tv, argmax) only at
            the supervised slots (:mod:`lightning_drafts.core.chain_positions`): the same loss, gradients
            and statistics. ``False`` computes them at every slot: the reference the tests compare with.
            (Every DSpark block has a supervised slot 0, so no block is left out.)
        **base_kwargs: :class:`~lightning_drafts.training.module.DraftModule` arguments. Learning rate 6e-4 by default.

    ``compute_loss`` returns a :class:`~lightning_drafts.core.draft_output.DraftOutput`: ``correct`` /
    ``valid`` ``[M, K]`` (argmax of the Markov-corrected logits with teacher-forced previous tokens ==
    gold; the eval mask), metrics ``accept_rate_k{k}``, ``accept_rate``, ``tau``, the confidence
    calibration, ``ce_loss`` / ``tv_loss`` / ``confidence_loss`` and ``blocks``.
    """

    architecture = "DSparkDraftModel"  # the default (serving) export; layout="nemo" writes Qwen3DSparkModel

    def __init__(
        self,
        target: TargetSpec,
        mask_token_id: int | None = None,
        target_layer_ids: Sequence[int] | None = None,
        num_draft_layers: int = 5,
        block_size: int = 7,
        num_anchors: int = 512,
        markov_rank: int = 256,
        markov_head_type: str = "vanilla",
        confidence_head_alpha: float = 1.0,
        confidence_head_with_markov: bool = True,
        ce_loss_alpha: float = 0.1,
        l1_loss_alpha: float = 0.9,
        loss_decay_gamma: float | None = 4.0,
        freeze_embeddings: bool = True,
        draft_attn_backend: str = "auto",
        draft_overrides: dict[str, int] | None = None,
        draft_seed: int = 0,
        logits_chunk_blocks: int | None = 128,
        block_valid_only: bool = True,
        learning_rate: float = 6e-4,
        **base_kwargs: Any,
    ) -> None:
        # Cheap checks first: a real target takes minutes to load.
        check_bool("block_valid_only", block_valid_only)
        check_int("num_draft_layers", num_draft_layers, 1)
        BLOCK_SIZE.check(block_size)
        check_int("num_anchors", num_anchors, 1)
        MARKOV_RANK.check(markov_rank)
        MARKOV_HEAD_TYPE.check(markov_head_type)
        _check_loss_weights(ce_loss_alpha, l1_loss_alpha, confidence_head_alpha)
        CONFIDENCE_HEAD_WITH_MARKOV.check(
            confidence_head_with_markov, confidence_head=confidence_head_alpha > 0, markov_rank=markov_rank
        )
        if loss_decay_gamma is not None and not (is_number(loss_decay_gamma) and loss_decay_gamma > 0):
            raise ValueError(
                f"loss_decay_gamma = {loss_decay_gamma!r} must be > 0, or None for uniform slot weights"
            )
        if draft_attn_backend not in BLOCK_BACKENDS:
            raise ValueError(
                f"draft_attn_backend {draft_attn_backend!r} is unknown; choose one of {BLOCK_BACKENDS}"
            )
        if logits_chunk_blocks is not None:
            check_int("logits_chunk_blocks", logits_chunk_blocks, 1)
        # In the signature, not set by default inside: the CLI reads defaults from signatures.
        super().__init__(target=target, learning_rate=learning_rate, **base_kwargs)
        self.mask_token_id = check_mask_token_id(mask_token_id, self.target, self.hparams.get("pad_token_id"))
        num_layers = self.target.num_layers
        if target_layer_ids is None:
            target_layer_ids = default_target_layer_ids(num_layers, num_draft_layers)
        self.target_layer_ids = check_target_layer_ids(target_layer_ids, num_layers)
        self.block_size = block_size
        self.num_anchors = num_anchors
        self.loss_weights = LossWeights(ce=ce_loss_alpha, tv=l1_loss_alpha, conf=confidence_head_alpha)
        self.loss_decay_gamma = loss_decay_gamma
        self.draft_attn_backend = draft_attn_backend
        self.logits_chunk_blocks = logits_chunk_blocks
        config = draft_config(self.target.text_config, num_draft_layers, overrides=draft_overrides)
        embedding, head = self.target.input_embeddings.weight, self.target.lm_head.weight
        if embedding.shape[0] != head.shape[0]:
            raise ValueError(
                f"the target's input embedding has {embedding.shape[0]} rows but its LM head {head.shape[0]}; "
                "DSpark copies both and needs one vocabulary"
            )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(draft_seed)
            self.draft = DSparkDraft(
                config,
                len(self.target_layer_ids),
                markov_rank=markov_rank,
                markov_head_type=markov_head_type,
                confidence_head=confidence_head_alpha > 0,
                confidence_head_with_markov=confidence_head_with_markov,
            )
        self.draft.copy_target_weights(embedding, head, freeze=freeze_embeddings)
        self.register_ratio_metrics(self._ratio_names())

    @property
    def has_confidence_head(self) -> bool:
        return self.draft.confidence_head is not None

    # --- anchors and the objective ---------------------------------------------------------------

    def check_data(self, datamodule: Any) -> None:
        check_mask_token_against_data(self.mask_token_id, datamodule)

    def sample_anchors(
        self, batch: Mapping[str, Tensor] | PackedBatch, generator: torch.Generator | None = None
    ) -> Tensor:
        """``[B, N]`` anchors (row positions, -1 = none): ``min(num_anchors, valid anchors)`` per document,
        a valid anchor being a supervised token followed by a supervised token of the same document."""
        packed = self.prepare_batch(batch)
        return sample_anchors(packed, self.block_size, self.num_anchors, generator, partial_blocks=True)

    def compute_loss(
        self, batch: Mapping[str, Tensor] | PackedBatch, anchors: Tensor | None = None
    ) -> DraftOutput:
        """The objective on one micro-batch; deterministic given ``anchors`` (``[B, N]``, -1 = none)."""
        packed = self.prepare_batch(batch)
        if anchors is None:
            anchors = self.sample_anchors(packed, self.draws)
        else:
            anchors = check_anchors(packed, anchors, self.block_size, partial_blocks=True)
        layout = block_layout(packed, anchors, self.block_size)
        if layout.num_blocks == 0:
            return self._empty_output(packed.input_ids.device)
        output = self.target_output(packed, hooked_layer_ids(self.target_layer_ids, self.target.num_layers))
        features = context_features(output, self.target, packed, self.target_layer_ids)
        supervision = block_supervision(packed, layout)
        hidden = self._draft_hidden(packed, layout, features, self._needed_slots(supervision.valid))
        teacher_hidden = output.final_states(
            (layout.rows[:, None], supervision.teacher_positions), needed=supervision.valid
        )
        # Overlapping blocks share teacher positions: the flat row position names each one.
        teacher_keys = layout.rows[:, None] * layout.width + supervision.teacher_positions
        return self._objective(hidden, supervision, teacher_hidden, teacher_keys, packed.input_ids.numel())

    def feature_request(self) -> FeatureRequest:
        """The decoder layers among the feature ids at every token; the final-norm state where a slot's
        teacher reads it (before each supervised token), or everywhere when it is a feature itself."""
        last = self.target.num_layers - 1
        final = "all" if last in self.target_layer_ids else "next_supervised"
        return FeatureRequest(hooked_layer_ids(self.target_layer_ids, self.target.num_layers), final)

    def _needed_slots(self, valid: Tensor) -> Tensor | None:
        """The slots whose states the objective reads (None: every one, the reference path): the supervised
        ones, with every earlier slot of the block (the ``rnn`` Markov head runs over them in order; the
        eval mask is a prefix anyway). Elsewhere a state meets only zero weights and masked statistics."""
        if not self.hparams.block_valid_only:
            return None
        return valid.flip(1).cumsum(1).flip(1) > 0

    def _draft_hidden(
        self, packed: PackedBatch, layout: BlockLayout, features: Tensor, needed: Tensor | None = None
    ) -> Tensor:
        tokens = layout.block_input_ids(packed.input_ids, self.mask_token_id)
        mask = build_block_mask(
            layout, resolve_block_backend(self.draft_attn_backend, packed.input_ids.device)
        )
        return self.draft(
            layout.gather_context(features),
            layout.gather_context(packed.position_ids),
            tokens,
            layout.block_position_ids(packed.position_ids),
            mask,
            needed,
        )

    def _objective(
        self,
        hidden: Tensor,
        supervision: BlockSupervision,
        teacher_hidden: Tensor,
        teacher_keys: Tensor,
        key_span: int,
    ) -> DraftOutput:
        valid = supervision.valid
        weights = decay_weights(self.block_size, self.loss_decay_gamma, valid.device) * valid
        sizes = self._chunk_sizes(supervision, teacher_keys, key_span)
        with self.draft.head_cast_once():
            chunked = over_chunks(
                self._chunk_terms,
                self.logits_chunk_blocks,
                (
                    hidden,
                    supervision.previous,
                    supervision.labels,
                    valid,
                    weights,
                    teacher_hidden,
                    teacher_keys,
                    sizes,
                ),
                self.draft.head_parameters(),
            )
        numerator, ce_sum, tv_sum, conf_sum, predicted, alpha, confidence = chunked
        weight_sum = weights.sum()
        loss = normalise(numerator, weight_sum)
        sums = acceptance_sums(alpha, valid)
        if self.has_confidence_head:
            sums.update(confidence_sums(confidence, alpha, valid, weights))
        local = {
            name: (term.detach() / (weight_sum + LOSS_EPS))
            for name, term in zip(LOSS_TERMS, (ce_sum, tv_sum, conf_sum), strict=True)
        }
        return self._output(loss, (predicted == supervision.labels) & valid, valid, sums, local, len(hidden))

    def _chunk_sizes(self, supervision: BlockSupervision, teacher_keys: Tensor, key_span: int) -> Tensor:
        """Per chain ``[M, 3]``, on the host: its kept positions (the supervised ones under
        ``block_valid_only``, else all) and the teacher positions and previous tokens first seen in its logits
        chunk there. A chunk's sums size its index of kept positions and its two unique sets, so the chunks
        never read the device: the step reads it once, here."""
        valid = supervision.valid
        kept = valid if self.hparams.block_valid_only else torch.ones_like(valid)
        bounds = chunk_bounds(len(valid), self.logits_chunk_blocks or len(valid))
        sizes = torch.stack(
            [
                kept.sum(1),
                first_seen_per_chain(teacher_keys, kept, bounds, key_span),
                first_seen_per_chain(supervision.previous, kept, bounds, self.target.vocab_size),
            ],
            dim=1,
        )
        return sizes.cpu()

    def _chunk_terms(
        self,
        hidden: Tensor,
        previous: Tensor,
        labels: Tensor,
        valid: Tensor,
        weights: Tensor,
        teacher_hidden: Tensor,
        teacher_keys: Tensor,
        sizes: Tensor,
    ) -> tuple[Tensor, ...]:
        kept, distinct_keys, distinct_previous = sizes.sum(0).tolist()  # host arithmetic (see _chunk_sizes)
        # Validity, not the weight: a supervised slot whose decay underflows to 0 still counts in alpha's sums.
        supervised_only = self.hparams.block_valid_only
        positions = ChainPositions.of(valid, supervised_only, kept if supervised_only else None)
        latents, confidence = self.draft.slot_heads(hidden, previous)
        logits = self.draft.vocabulary_logits(
            positions.gather(hidden),
            None if latents is None else positions.gather(latents),
            positions.gather(previous),
            distinct_previous,
        )
        # Each distinct teacher position once: its logits and softmax are the same for every slot reading it.
        keys = positions.gather(teacher_keys)
        distinct, teacher_index = sorted_unique(keys, distinct_keys)
        first = torch.full_like(distinct, keys.numel()).scatter_reduce_(
            0, teacher_index, torch.arange(keys.numel(), device=keys.device), "amin"
        )
        # The target's own head: equal to the frozen copy, and it cannot drift if the copy is unfrozen.
        teacher_logits = self.target.logits(positions.gather(teacher_hidden).index_select(0, first))
        ce, l1, predicted = distribution_terms(
            logits, teacher_logits, positions.gather(labels), teacher_index, consume=True
        )
        # A slot left out gets ce = l1 = 0 (alpha 1): each meets a zero weight or the eval mask only.
        ce, l1 = positions.scatter(ce), positions.scatter(l1)
        alpha = acceptance_probability(l1)
        if confidence is None:
            conf_sum, confidence = ce.new_zeros(()), torch.zeros_like(alpha)
        else:
            conf_sum = (confidence_bce(confidence, alpha) * weights).sum()
        ce_sum, tv_sum = (ce * weights).sum(), (l1 * weights).sum()
        # One differentiable output: the weighted mix is known up front, so chunks backpropagate it once.
        return (
            self.loss_weights.numerator(ce_sum, tv_sum, conf_sum),
            ce_sum.detach(),
            tv_sum.detach(),
            conf_sum.detach(),
            # -1 is never a label: a slot left out is never correct.
            positions.scatter(predicted, -1),
            alpha,
            confidence.detach(),
        )

    def _output(
        self, loss: Tensor, correct: Tensor, valid: Tensor, sums: Sums, local: dict[str, Tensor], blocks: int
    ) -> DraftOutput:
        metrics = {name: ratio(num, den) for name, (num, den) in sums.items()}
        metrics.update(local)
        metrics["blocks"] = torch.tensor(float(blocks), device=loss.device)
        return DraftOutput(loss=loss, correct=correct, valid=valid, metrics=metrics, sums=sums)

    def _empty_output(self, device: torch.device) -> DraftOutput:
        """No anchor anywhere: a zero loss still connected to every trainable parameter (and through the
        same denominator all-reduce), so each rank runs backward and DDP / FSDP stay in lockstep."""
        trainable = [p for p in self.draft.parameters() if p.requires_grad]
        connected = torch.stack([p.sum() for p in trainable]).sum() * 0.0
        zero = torch.zeros((), device=device)
        loss = normalise(self.loss_weights.numerator(connected, zero, zero), zero)
        empty = torch.zeros(0, self.block_size, dtype=torch.bool, device=device)
        sums = {name: (zero, zero) for name in self._ratio_names()}
        return self._output(loss, empty, empty.clone(), sums, dict.fromkeys(LOSS_TERMS, zero), 0)

    def _ratio_names(self) -> list[str]:
        names = [f"accept_rate_k{k}" for k in range(self.block_size)] + ["accept_rate", "tau"]
        if self.has_confidence_head:
            names += ["confidence_abs_error", "confidence_bias", "confidence_cumprod_bias"]
        return names

    # --- export ------------------------------------------------------------------------------------

    def export(self, output_dir: str | Path, layout: str | None = None) -> Path:
        """Write the draft to ``output_dir``: ``layout="specforge"`` is the SpecForge / SGLang
        ``DSparkDraftModel`` serving layout, ``"nemo"`` NeMo's self-contained ``Qwen3DSparkModel`` layout
        (with the embedding / LM head copies); None (default) takes SpecForge's when the draft fits it
        (frozen embedding / LM head copies; any Markov head), else NeMo's with a warning. Both reload with
        :meth:`load_exported`."""
        return export_draft(
            self.draft,
            Path(output_dir),
            self.dspark_config(),
            self.target.num_layers,
            self.training_record(),
            layout=layout,
        )

    def load_exported(self, path: str | Path) -> None:
        """Load an export (either layout) into this module after checking it was made for this setup."""
        load_into_module(self.draft, Path(path), self.dspark_config())

    def training_record(self) -> dict[str, Any]:
        """The training hyperparameters that are not architecture, as an export records them."""
        return {
            "num_anchors": self.num_anchors,
            "ce_loss_alpha": self.loss_weights.ce,
            "l1_loss_alpha": self.loss_weights.tv,
            "confidence_head_alpha": self.loss_weights.conf,
            "loss_decay_gamma": self.loss_decay_gamma,
            **self.target_record(),
        }

    def dspark_config(self) -> dict[str, Any]:
        """The DSpark fields of an exported config (what a loader must match)."""
        head = self.draft.markov_head
        return {
            "block_size": self.block_size,
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids),
            "markov_rank": 0 if head is None else head.rank,
            "markov_head_type": "vanilla" if head is None else head.head_type,
            "enable_confidence_head": self.has_confidence_head,
            "confidence_head_with_markov": self.draft.confidence_with_markov,
        }


def _check_loss_weights(ce: Any, tv: Any, confidence: Any) -> None:
    named = {"ce_loss_alpha": ce, "l1_loss_alpha": tv, "confidence_head_alpha": confidence}
    for name, value in named.items():
        if not (is_number(value) and value >= 0):
            raise ValueError(f"{name} = {value!r} must be a number >= 0")
    if not any(value > 0 for value in named.values()):
        raise ValueError(f"{', '.join(named)} are all 0: nothing would train; set at least one > 0")
