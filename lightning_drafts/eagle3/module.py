"""Eagle3Module and MLAEagle3Module: EAGLE-3 draft training with exact sequence packing.

Both share :class:`Eagle3Base` (teacher, TTT unroll, loss, vocabulary mapping, export) and differ only in
the draft ``nn.Module`` they build: the dense Llama-style draft or the DeepSeek MLA draft.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor

from lightning_drafts.attention.backends import (
    block_causal_mask,
    block_mask_from_mask_mod,
    document_causal_mask_mod,
)
from lightning_drafts.attention.document_tiles import tile_block_causal_mask
from lightning_drafts.attention.query_subset import (
    flat_document_starts,
    subset_causal_mask,
    subset_causal_mask_mod,
    tile_subset_causal_mask,
)
from lightning_drafts.core.batch import PackedBatch
from lightning_drafts.core.checks import check_bool, check_int, is_number
from lightning_drafts.core.draft_output import DraftOutput
from lightning_drafts.core.target_features import FeatureRequest
from lightning_drafts.eagle3.draft_base import Eagle3Draft
from lightning_drafts.eagle3.export import export_draft
from lightning_drafts.eagle3.live_slots import live_slots, ttt_unroll_live
from lightning_drafts.eagle3.llama_draft import build_llama_draft
from lightning_drafts.eagle3.mla_draft import build_mla_draft
from lightning_drafts.eagle3.rules import TARGET_LAYER_IDS
from lightning_drafts.eagle3.step_objective import StepObjective
from lightning_drafts.eagle3.ttt import (
    StepState,
    TeacherSignal,
    TTTSupervision,
    eagle3_objective,
    ttt_supervision,
    ttt_unroll,
)
from lightning_drafts.eagle3.vocab_coverage import CoverageCheck
from lightning_drafts.eagle3.vocab_mapping import (
    VocabMapping,
    build_vocab_mapping,
    check_draft_vocab_size,
    count_supervised_tokens,
    load_token_counts,
)
from lightning_drafts.serving.export_files import initial_fingerprints
from lightning_drafts.training.module import DraftModule
from lightning_drafts.training.target import TargetSpec, default_capture_layers

DRAFT_BACKENDS = ("auto", "sdpa", "eager", "flex")


class Eagle3Base(DraftModule):
    """The EAGLE-3 objective shared by the dense and the MLA draft
    (docs/concepts/eagle3.md#training-time-test).

    Args:
        target: hub id / local path, config dict (random tiny target) or ``PreTrainedModel``.
        target_layer_ids: three distinct, ascending decoder-layer ids whose **outputs** feed ``fc``
            (HF ``hidden_states[id + 1]``); ``None`` = ``[1, N // 2 - 1, N - 4]``.
        ttt_length: TTT steps ``K`` (int >= 1; default 7).
        draft_vocab_size: LM-head rows ``V_d``; ``None`` (or ``V``) = the full target vocabulary.
        loss_decay_gamma: step weight ``gamma^k`` (normalised by their sum); default 0.8.
        token_frequencies: per-target-id counts of supervised tokens (tensor, list, or a ``torch.save``
            file) to build the draft vocabulary from. Without it, ``fit`` scans the attached datamodule's
            train loader in ``setup``; or call :meth:`build_vocab_mapping` yourself before training.
        draft_attn_backend: ``"auto"`` (flex ``BlockMask`` on CUDA, dense block-causal mask elsewhere),
            ``"sdpa"`` / ``"eager"`` (dense mask), or ``"flex"``.
        lk_loss_type: the per-step loss (:mod:`lightning_drafts.eagle3.step_objective`): ``None`` (soft
            cross-entropy), LK ``"alpha"`` (``-mean log alpha``) or ``"lambda"`` (soft CE and
            ``1 - mean alpha`` mixed by ``lk_kl_scale * exp(-lk_kl_decay * mean alpha)``), with
            ``alpha = sum_v min(P_teacher, q_draft)``.
        lk_kl_scale: ``"lambda"``'s scale, in [0, 1] (1.0).
        lk_kl_decay: ``"lambda"``'s decay, >= 0 (3.0).
        draft_biases: whether the dense draft's attention / MLP projections have biases. ``None``
            (default) follows the target's ``attention_bias`` / ``mlp_bias``, as the reference trainers
            do (docs/concepts/eagle3.md#dense-draft), so losses and gradients match theirs; only vLLM serves
            such biases, SGLang's and SpecForge's ``LlamaForCausalLMEagle3`` have none (the export warns).
            ``False``: a bias-free draft that vLLM, SGLang and SpecForge all serve as trained. The MLA draft
            has no biases (``True`` is refused there).
        ttt_live_slots_only: run each TTT step only at the slots with a supervised prediction left at that
            step or later (step 0 still computes keys and values everywhere;
            :mod:`lightning_drafts.eagle3.live_slots`): the same loss, gradients and statistics. ``False``
            runs every slot at every step: the reference the tests compare with.
        lm_head_init: where the draft's LM head starts. ``"random"`` (default): normal with the target's
            ``initializer_range``, as NeMo Automodel starts it. ``"target"``: the target's own
            LM head rows for the draft vocabulary (its input embedding when the two are tied), as vLLM's
            speculators starts it: the draft then only has to reach the target's final hidden space
            (measured against the random start: docs/results/real-model.md).
        train_lm_head: whether the LM head trains (default ``True``). ``False`` keeps the target's rows
            frozen (speculators' choice; needs ``lm_head_init: target``).
        **kwargs: every :class:`~lightning_drafts.training.module.DraftModule` argument (optimiser, target backend...).
    """

    # The ``draft_class`` an export records, which ``load_eagle3`` rebuilds: a subclass inherits it, so its
    # exports reload into the family class it extends.
    exported_as: str

    def __init__(
        self,
        target: TargetSpec,
        target_layer_ids: Sequence[int] | None = None,
        ttt_length: int = 7,
        draft_vocab_size: int | None = None,
        loss_decay_gamma: float = 0.8,
        token_frequencies: Tensor | Sequence[int] | str | None = None,
        draft_attn_backend: str = "auto",
        lk_loss_type: str | None = None,
        lk_kl_scale: float = 1.0,
        lk_kl_decay: float = 3.0,
        draft_biases: bool | None = None,
        ttt_live_slots_only: bool = True,
        lm_head_init: str = "random",
        train_lm_head: bool = True,
        **kwargs: Any,
    ) -> None:
        check_bool("ttt_live_slots_only", ttt_live_slots_only)
        _check_lm_head_options(lm_head_init, train_lm_head)
        check_int("ttt_length", ttt_length, 1, hint="TTT steps per slot")
        if draft_biases is not None and not isinstance(draft_biases, bool):
            raise ValueError(
                f"draft_biases = {draft_biases!r}; write true, false or null (follow the target)"
            )
        _check_gamma(loss_decay_gamma)
        if kwargs.get("activation_checkpointing"):
            raise ValueError(
                "activation_checkpointing=True is not supported for EAGLE-3: its single layer runs once per "
                "TTT step and appends to the TTT cache as it runs, so recomputing it in backward would corrupt "
                "the cache; set activation_checkpointing: false"
            )
        _check_draft_backend(draft_attn_backend)
        objective = StepObjective(lk_loss_type, lk_kl_scale, lk_kl_decay)
        if draft_vocab_size is not None:
            # Type and sign only, before the (possibly large) target is loaded; V is checked below.
            check_draft_vocab_size(draft_vocab_size, vocab_size=draft_vocab_size)
        super().__init__(target=target, **kwargs)
        # Counts are data, not a hyperparameter: the mapping they produce lives in the buffers.
        self.remove_ignored_hparams(["token_frequencies"])
        getattr(self, "_hparams_initial", {}).pop("token_frequencies", None)

        self.objective = objective
        self.target_layer_ids = resolve_target_layer_ids(target_layer_ids, self.target.num_layers)
        vocab_size = self.target.vocab_size
        embedding_rows = self.target.input_embeddings.weight.shape[0]
        if embedding_rows != vocab_size:
            raise ValueError(
                f"the target's input embedding has {embedding_rows} rows but its LM head {vocab_size}; "
                "EAGLE-3 needs one vocabulary for both"
            )
        draft_size = check_draft_vocab_size(draft_vocab_size, vocab_size)
        self.draft: Eagle3Draft = self.build_draft(
            self.target.text_config, vocab_size, draft_size, draft_biases
        )
        self.draft.copy_embeddings(self.target.input_embeddings.weight)
        # The export validator proves a randomly initialised tensor moved away from its init (see
        # export_check): the LM head, or fc when the head starts as the target's rows.
        checked = "lm_head.weight" if lm_head_init == "random" else "fc.weight"
        self.init_fingerprints = initial_fingerprints(self.draft, (checked,))
        self.draft.lm_head.weight.requires_grad_(train_lm_head)
        # Saved in checkpoints, so a resumed run never trains against an unset mapping.
        self.register_buffer("vocab_mapping_built", torch.tensor(draft_size == vocab_size))
        self.vocab_mapping: VocabMapping | None = None
        if draft_size == vocab_size:
            self._start_lm_head()
        if token_frequencies is not None:
            self.build_vocab_mapping(token_frequencies)
        self.coverage_check = CoverageCheck(draft_size, vocab_size)
        self.register_ratio_metrics(["accuracy", "draft_vocab_coverage"])

    @staticmethod
    def build_draft(
        text_config: Any, vocab_size: int, draft_vocab_size: int, biases: bool | None
    ) -> Eagle3Draft:
        """The draft ``nn.Module`` (each subclass picks its architecture; ``biases``: ``draft_biases``)."""
        raise NotImplementedError("use Eagle3Module or MLAEagle3Module")

    @property
    def compresses_vocab(self) -> bool:
        return self.draft.draft_vocab_size < self.target.vocab_size

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["draft_init_fingerprints"] = dict(self.init_fingerprints)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        # A resumed module was re-initialised with other random values; the original init is the one to check.
        self.init_fingerprints = dict(checkpoint.get("draft_init_fingerprints", {}))

    # --- vocabulary mapping ---------------------------------------------------------------------

    def build_vocab_mapping(self, counts: Tensor | Sequence[int] | str | Path) -> VocabMapping:
        """Choose the draft vocabulary from per-target-id supervised-token ``counts`` and store it.

        ``counts`` is a long ``[V]`` tensor (see :func:`~lightning_drafts.eagle3.vocab_mapping.
        count_supervised_tokens`), a list, or a ``torch.save``-d file. The mapping goes into the draft's
        ``d2t`` / ``t2d`` buffers (saved in checkpoints and exports). Returns the mapping with its
        ``coverage``: the share of counted tokens the draft vocabulary can predict.
        """
        counts = load_token_counts(counts, self.target.vocab_size)
        mapping = build_vocab_mapping(counts, self.draft.draft_vocab_size, self._special_token_ids())
        self.draft.set_vocab_mapping(mapping.selected_token_ids)
        self._start_lm_head()
        self.vocab_mapping_built.fill_(True)
        self.vocab_mapping = mapping
        (rank_zero_warn if mapping.filled else rank_zero_info)(mapping.summary())
        return mapping

    def setup(self, stage: str) -> None:
        """Build the vocabulary mapping from the datamodule's train loader when it is still unset.

        Runs before the optimiser is built. On resume the checkpoint's mapping overwrites this one.
        """
        if stage != "fit" or bool(self.vocab_mapping_built):
            return
        datamodule = getattr(self.trainer, "datamodule", None)
        if datamodule is None:
            raise ValueError(
                f"draft_vocab_size={self.draft.draft_vocab_size} < the target vocabulary "
                f"({self.target.vocab_size}) needs token frequencies: pass token_frequencies=..., call "
                "build_vocab_mapping(counts) before fit, or fit with a datamodule"
            )
        # Tokens only: a data module training from captured features need not read them to count.
        loader = getattr(datamodule, "token_dataloader", datamodule.train_dataloader)()
        counts = count_supervised_tokens(loader, self.target.vocab_size)
        strategy = self.trainer.strategy
        # Ranks may read different shards; a sum keeps the ranking exact either way.
        counts = strategy.reduce(counts.to(strategy.root_device), reduce_op="sum").cpu()
        self.build_vocab_mapping(counts)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self.compresses_vocab or self.coverage_check.judged:
            return
        covered, supervised = outputs["draft_output"].sums["draft_vocab_coverage"]
        warning = self.coverage_check.add(float(covered), float(supervised))
        if warning is not None:
            rank_zero_warn(warning)

    def on_train_end(self) -> None:
        # A run shorter than the window is judged on what it saw.
        warning = self.coverage_check.judge() if self.compresses_vocab else None
        if warning is not None:
            rank_zero_warn(warning)

    def _start_lm_head(self) -> None:
        """Copy the target's LM-head rows of the draft vocabulary into the draft's (``lm_head_init:
        target``); called whenever the vocabulary is chosen, as the rows depend on it."""
        if self.hparams.get("lm_head_init", "random") != "target":
            return
        head = self.target.lm_head
        if head.bias is not None:
            raise ValueError(
                "lm_head_init: target copies the target's LM head, but it has a bias the draft's head "
                "cannot hold; use lm_head_init: random"
            )
        self.draft.copy_lm_head(head.weight)

    def _special_token_ids(self) -> list[Any]:
        names = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")
        return [*self.target.special_token_ids(names), self.hparams.get("pad_token_id")]

    def _require_vocab_mapping(self) -> None:
        if not bool(self.vocab_mapping_built):
            raise ValueError(
                f"the draft vocabulary ({self.draft.draft_vocab_size} of {self.target.vocab_size} ids) is not "
                "built: pass token_frequencies=..., call build_vocab_mapping(counts), or fit with a datamodule"
            )

    # --- the objective --------------------------------------------------------------------------

    def compute_loss(
        self, batch: Mapping[str, Tensor] | PackedBatch, anchors: Tensor | None = None
    ) -> DraftOutput:
        """EAGLE-3's TTT loss and prediction chains on one (packed or padded) micro-batch."""
        if anchors is not None:
            raise ValueError("EAGLE-3 trains every supervised slot and takes no anchors; pass anchors=None")
        packed = self.prepare_batch(batch)
        self._require_vocab_mapping()
        return self.loss_from_teacher(packed, self.teacher_signal(packed))

    def loss_from_teacher(self, packed: PackedBatch, teacher: TeacherSignal) -> DraftOutput:
        """The TTT loss and chains of ``packed`` against ``teacher`` (what :meth:`compute_loss` computes
        from :meth:`teacher_signal`; benchmarks/teacher_storage.py passes a teacher read from disk)."""
        supervision = ttt_supervision(packed, teacher, self.hparams.ttt_length)
        return eagle3_objective(
            self.draft.compute_logits,
            self._unroll(packed, teacher, supervision),
            packed,
            teacher,
            supervision,
            self.hparams.loss_decay_gamma,
            self.objective,
        )

    def _unroll(
        self, packed: PackedBatch, teacher: TeacherSignal, supervision: TTTSupervision
    ) -> list[StepState]:
        if not self.hparams.ttt_live_slots_only:
            mask = self.draft_attention_mask(packed)
            return ttt_unroll(self.draft, packed, teacher.aux_hidden_states, mask, self.hparams.ttt_length)
        starts = flat_document_starts(packed.doc_start)
        return ttt_unroll_live(
            self.draft,
            packed,
            teacher.aux_hidden_states,
            lambda slots: self.live_attention_mask(starts, slots),
            live_slots(supervision),
        )

    def draft_logits(self, batch: Mapping[str, Tensor] | PackedBatch) -> Tensor:
        """Draft logits at every slot and TTT step, ``[K, B, T, V_d]`` (for inspection and tests: every
        slot runs every step here, live or not)."""
        packed = self.prepare_batch(batch)
        teacher = self.teacher_signal(packed)
        mask = self.draft_attention_mask(packed)
        states = ttt_unroll(self.draft, packed, teacher.aux_hidden_states, mask, self.hparams.ttt_length)
        return torch.stack(
            [self.draft.compute_logits(state.hidden).view(*packed.shape, -1) for state in states]
        )

    @torch.no_grad()
    def teacher_signal(self, packed: PackedBatch) -> TeacherSignal:
        """One frozen target forward (or the batch's captured features): captured layers; teacher logits
        and in-vocabulary bits at the loss-mask positions only (restricted to the draft vocabulary before
        the matmul, from the final hidden state there, so any draft vocabulary trains from one capture)."""
        output = self.target_output(packed, self.target_layer_ids)
        aux = torch.cat(output.hidden_states, dim=-1)
        last = output.final_states(packed.loss_mask)
        if not self.compresses_vocab:
            return self.teacher_from_logits(packed, aux, self.target.logits(last))
        logits = self.target.logits(last, self.draft.selected_token_ids)
        return self.teacher_from_logits(packed, aux, logits, self.target.greedy_tokens(last))

    def teacher_from_logits(
        self, packed: PackedBatch, aux: Tensor, logits: Tensor, greedy: Tensor | None = None
    ) -> TeacherSignal:
        """The teacher from its logits over the draft vocabulary at the loss-mask positions (row-major,
        ``[N, V_d]``) and the target's full-vocabulary greedy token there (``[N]``; only ``None`` when the
        draft vocabulary is the full one, where every greedy token is in it)."""
        supervised = packed.loss_mask
        row = torch.cumsum(supervised.reshape(-1), 0).reshape(supervised.shape) - 1
        row = row.masked_fill(~supervised, -1)
        if greedy is None:
            if self.compresses_vocab:
                raise ValueError(
                    f"draft_vocab_size={self.hparams.draft_vocab_size} compresses the vocabulary, so the teacher "
                    "needs the target's greedy token at each supervised position (greedy); pass it"
                )
            in_vocab = supervised.clone()
        else:
            # Each supervised position reads its own row of ``greedy`` (a gather: a boolean-mask write would
            # wait for the device to count the positions); the others (row -1) read a False appended last.
            looked_up = self.draft.t2d[greedy]
            in_vocab = torch.cat([looked_up, looked_up.new_zeros(1)])[row]
        return TeacherSignal(aux, logits, row, in_vocab)

    def feature_request(self) -> FeatureRequest:
        """The captured layers at every token; the final hidden state at supervised tokens (the teacher)."""
        return FeatureRequest(tuple(self.target_layer_ids), "supervised")

    def draft_attention_mask(self, packed: PackedBatch) -> Any:
        """Block 1's document-causal mask, built once per batch and shared by every TTT step that runs
        every slot: a flex ``BlockMask`` (``flex``), the dense bool ``[B, 1, T, T]`` (``eager``, the
        reference math) or its query tiles (``sdpa``: attention then skips the keys of other documents
        and of the future)."""
        backend = self._draft_backend(packed.input_ids.device)
        if backend == "flex":
            batch, width = packed.shape
            mask_mod = document_causal_mask_mod(packed.doc_ids)
            return block_mask_from_mask_mod(mask_mod, batch, width, width, packed.input_ids.device)
        if backend == "sdpa":
            # Straight from the document starts: the dense [B, 1, T, T] form grows with the square of T.
            return tile_block_causal_mask(packed.doc_start)
        return block_causal_mask(packed.doc_ids)

    def live_attention_mask(self, starts: Tensor, slots: Tensor) -> Any:
        """Block 1's mask for the queries at flat ``slots`` (ascending) against the micro-batch's
        ``B * T`` step-0 keys, in the form :meth:`draft_attention_mask` gives (``starts``:
        :func:`~lightning_drafts.attention.query_subset.flat_document_starts`)."""
        backend = self._draft_backend(slots.device)
        if backend == "flex":
            mask_mod = subset_causal_mask_mod(starts, slots)
            return block_mask_from_mask_mod(mask_mod, 1, slots.numel(), starts.numel(), slots.device)
        if backend == "sdpa":
            return tile_subset_causal_mask(starts, slots)
        return subset_causal_mask(starts, slots)

    def _draft_backend(self, device: torch.device) -> str:
        backend = self.hparams.draft_attn_backend
        if backend == "auto":
            return "flex" if device.type == "cuda" else "sdpa"
        return backend

    # --- export ---------------------------------------------------------------------------------

    def export(self, output_dir: str | Path) -> Path:
        """Write the serving layout (see :mod:`lightning_drafts.eagle3.export`; ``lightning-drafts export``
        validates it against the target before it lands)."""
        return export_draft(
            self.draft,
            output_dir,
            draft_class=self.exported_as,
            target_layer_ids=self.target_layer_ids,
            ttt_length=self.hparams.ttt_length,
            loss_decay_gamma=self.hparams.loss_decay_gamma,
            target_record=self.target_record(),
            init_fingerprints=self.init_fingerprints,
            vocab_mapping_built=bool(self.vocab_mapping_built),
        )


class Eagle3Module(Eagle3Base):
    """EAGLE-3 with the dense Llama-style draft (Llama, Qwen3, Phi-3, ... targets).

    Exports to vLLM / SGLang's ``LlamaForCausalLMEagle3`` layout. See :class:`Eagle3Base` for arguments.
    """

    exported_as = "Eagle3Module"

    @staticmethod
    def build_draft(
        text_config: Any, vocab_size: int, draft_vocab_size: int, biases: bool | None
    ) -> Eagle3Draft:
        return build_llama_draft(text_config, vocab_size, draft_vocab_size, biases)


class MLAEagle3Module(Eagle3Base):
    """EAGLE-3 with the DeepSeek-V3 MLA draft (docs/concepts/eagle3.md#mla-draft), configured from a
    DeepSeek-V3 target.

    Exports vLLM's ``Eagle3DeepseekV2ForCausalLM`` layout, which also reloads into this class. See
    :class:`Eagle3Base` for arguments.
    """

    exported_as = "MLAEagle3Module"

    @staticmethod
    def build_draft(
        text_config: Any, vocab_size: int, draft_vocab_size: int, biases: bool | None
    ) -> Eagle3Draft:
        if biases:
            raise ValueError(
                "draft_biases = True, but the MLA draft has no biases (DeepSeek's MLA projections have none); "
                "leave draft_biases unset"
            )
        return build_mla_draft(text_config, vocab_size, draft_vocab_size)


def resolve_target_layer_ids(target_layer_ids: Sequence[int] | None, num_layers: int) -> list[int]:
    """The captured layers: the default recipe, or explicit ids meeting
    :data:`~lightning_drafts.eagle3.rules.TARGET_LAYER_IDS`."""
    if target_layer_ids is None:
        return default_capture_layers(num_layers)
    return list(TARGET_LAYER_IDS.check(target_layer_ids, num_layers=num_layers))


def _check_gamma(gamma: Any) -> None:
    if not (is_number(gamma) and math.isfinite(gamma) and gamma > 0):
        raise ValueError(f"loss_decay_gamma must be a finite number > 0 (the default is 0.8), got {gamma!r}")


def _check_lm_head_options(init: Any, train: Any) -> None:
    if init not in ("random", "target"):
        raise ValueError(f"lm_head_init = {init!r}; write random or target")
    check_bool("train_lm_head", train)
    if init == "random" and not train:
        raise ValueError(
            "train_lm_head: false with lm_head_init: random would keep a random LM head that predicts "
            "nothing; set lm_head_init: target (the target's rows, frozen) or train_lm_head: true"
        )


def _check_draft_backend(backend: Any) -> None:
    if backend not in DRAFT_BACKENDS:
        hint = (
            " (Block 1 runs through attention_with_lse: a dense mask or a flex BlockMask; use 'flex' on GPUs)"
        )
        hint = hint if backend == "flash" else ""
        raise ValueError(f"draft_attn_backend {backend!r} is not one of {DRAFT_BACKENDS}{hint}")
