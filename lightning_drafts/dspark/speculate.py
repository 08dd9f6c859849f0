"""DSpark block drafting from an exported draft, with its Markov head walked greedily (the evaluate plug-in).

Everything about the draft comes from the export: the network and ``block_size``, ``mask_token_id``,
``target_layer_ids`` and the Markov / confidence settings from ``config.json`` + ``model.safetensors``
(either layout, :mod:`lightning_drafts.dspark.export`). The SpecForge / SGLang layout ships no embedding
and no LM head: like the server, the speculator embeds with the target's embedding and reads logits with
the target's LM head (the modules themselves, shared, not copied). NeMo's layout ships its own copies and
serves with them.

One proposal from a verified prefix ``x_0 .. x_{L-1}`` (the last token, the previous round's bonus token,
has no target features yet), in the training frame of docs/concepts/dspark.md#draft-network and
docs/concepts/dspark.md#serving-layout:

* the block is ``[x_{L-1}, MASK, ..., MASK]`` (``block_size`` = K slots) at RoPE positions ``L-1 ..
  L-2+K``; the anchor slot is the last verified token;
* the context is the target's features of ``x_0 .. x_{L-2}``, every one strictly before the anchor (the
  training mask's ``kv < anchor``), read by NeMo's offset-1 ids: ``-1`` = the target's embedding output,
  ``L_t - 1`` = its final-norm output (the loop's ``last_hidden_state``), others = decoder-layer outputs
  (the only ids the loop captures, hence :attr:`DSparkSpeculator.target_layer_ids`); the block attends
  to itself both ways;
* slot k proposes the token at ``L + k`` (the **shifted** convention: slot 0 is supervised in training,
  so one block yields K proposals, and a perfect draft reaches an acceptance length of K + 1). Its
  logits are the backbone's plus the Markov bias of the token before it, and the walk is serial and
  greedy: slot 0's previous token is the anchor, slot k's is the argmax drafted at slot k - 1 (NeMo's
  ``sample_block_tokens`` at temperature 0). Along a fully accepted prefix these previous tokens are
  the gold ones training teacher-forces, which is why tau_sim estimates this walk.

SpecForge HEAD's generator feeds the Markov sampler the last K - 1 slots with DFlash's same-position
convention (docs/concepts/dspark.md#serving-layout), disagreeing with how DSpark trains; this follows
training.

The confidence head is not used to cut proposals: verification here is greedy and lossless, and how
many drafted tokens to verify is a serving-scheduler policy outside the spec. Its per-slot logits are
returned with every drafted block (:class:`DSparkBlock`) for callers that want to compare them with
what was accepted.

No KV cache: the context is re-encoded each round, which gives the keys an engine would have cached.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import Tensor

from lightning_drafts.blockdraft.config_fields import module_arguments
from lightning_drafts.dspark.draft import DSparkDraft
from lightning_drafts.dspark.layout import TARGET_COPIES, draft_from_config, read_config
from lightning_drafts.dspark.module import DSparkModule
from lightning_drafts.dspark.reload import load_exported_draft
from lightning_drafts.dspark.rules import EMBEDDING_FEATURE
from lightning_drafts.serving.export_files import WEIGHTS_FILE
from lightning_drafts.serving.family import VerifiedPrefix
from lightning_drafts.training.target import FrozenTarget


@dataclass(frozen=True)
class DSparkBlock:
    """One drafted block of K slots: the greedy walk's tokens (target ids ``[K]``), each slot's
    Markov-corrected logits given the walk's previous token (``[K, V]``), the backbone's final states
    (``[K, H]``) and the confidence head's fp32 logits (``[K]``, or None without a head)."""

    tokens: Tensor
    logits: Tensor
    hidden: Tensor
    confidence: Tensor | None


class DSparkSpeculator:
    """Greedy DSpark drafting: one block of ``block_size`` slots per round, Markov head walked serially.

    Args:
        draft: the draft network as loaded from the export, its ``embed_tokens`` / ``lm_head`` either the
            export's (NeMo layout) or the target's own modules (SpecForge layout).
        fields: the export's DSpark fields (:func:`~lightning_drafts.dspark.layout.read_config`).
        num_target_layers: L_t, the target's decoder-layer count (feature id L_t - 1 = final-norm output).
        num_steps: tokens proposed per round (at most ``block_size``).
    """

    def __init__(
        self, draft: DSparkDraft, fields: dict[str, Any], num_target_layers: int, num_steps: int
    ) -> None:
        self.block_size = int(fields["block_size"])
        if not 1 <= num_steps <= self.block_size:
            raise ValueError(
                f"num_steps = {num_steps} must be in [1, block_size = {self.block_size}]: a DSpark draft "
                "proposes at most the slots of one block per round"
            )
        self.draft = draft
        self.num_steps = num_steps
        self.mask_token_id = int(fields["mask_token_id"])
        self.feature_ids = tuple(int(i) for i in fields["target_layer_ids"])
        self.final_norm_feature = num_target_layers - 1
        # The decode loop captures decoder-layer outputs only; -1 and L_t - 1 come from elsewhere.
        self.target_layer_ids = tuple(i for i in self.feature_ids if 0 <= i < self.final_norm_feature)
        head = draft.markov_head
        self.recurrent = head is not None and head.head_type == "rnn"

    def propose(self, prefix: VerifiedPrefix) -> Tensor:
        return self.draft_block(prefix).tokens[: self.num_steps].to(prefix.tokens.device)

    @torch.no_grad()
    def draft_block(self, prefix: VerifiedPrefix) -> DSparkBlock:
        """The whole block drafted after ``prefix`` (its last token is the anchor)."""
        hidden = self.block_hidden(prefix)
        return self.walk(hidden, prefix.tokens[-1:].to(hidden.device))

    @torch.no_grad()
    def block_hidden(self, prefix: VerifiedPrefix) -> Tensor:
        """``[K, H]`` final-norm states of the block's slots (the backbone; no head applied)."""
        device = self.draft.fc.weight.device
        context = prefix.tokens.numel() - 1
        anchor = prefix.tokens[-1:].to(device)
        block = torch.cat([anchor, anchor.new_full((self.block_size - 1,), self.mask_token_id)])
        offsets = torch.arange(self.block_size, device=device)
        # With no sliding window a slot sees every context key and its whole block: an all-true mask.
        mask = torch.ones(1, 1, self.block_size, context + self.block_size, dtype=torch.bool, device=device)
        return self.draft(
            self.context_features(prefix).to(device),
            torch.arange(context, device=device),
            block[None],
            (context + offsets)[None],
            mask,
        )[0]

    def context_features(self, prefix: VerifiedPrefix) -> Tensor:
        """``[L - 1, F * H]``: the features ``feature_ids`` of the verified tokens before the anchor,
        concatenated in the trained order (what training's ``context_features`` gives there)."""
        before_anchor = prefix.tokens[:-1]
        by_id = dict(zip(self.target_layer_ids, prefix.hidden_states, strict=True))
        by_id[self.final_norm_feature] = prefix.last_hidden_state
        if EMBEDDING_FEATURE in self.feature_ids:
            # The target's embedding output, even when a NeMo export ships its own (possibly tuned) copy.
            embedding = prefix.target.input_embeddings
            by_id[EMBEDDING_FEATURE] = embedding(before_anchor.to(embedding.weight.device))
        return torch.cat([by_id[i][: before_anchor.numel()] for i in self.feature_ids], dim=-1)

    @torch.no_grad()
    def walk(self, hidden: Tensor, anchor: Tensor) -> DSparkBlock:
        """Greedy serial decoding of the block: slot k's previous token is the argmax of slot k - 1."""
        previous = anchor.long()
        logits, confidence = [], []
        for k in range(self.block_size):
            # Vanilla / gated biases depend on slot k alone; the rnn state runs over every earlier slot.
            start = 0 if self.recurrent else k
            step_logits, step_confidence = self.block_logits(hidden[start : k + 1], previous[start : k + 1])
            logits.append(step_logits[-1])
            confidence.append(None if step_confidence is None else step_confidence[-1])
            previous = torch.cat([previous, logits[-1].argmax(-1, keepdim=True)])
        return DSparkBlock(
            tokens=previous[1:],
            logits=torch.stack(logits),
            hidden=hidden,
            confidence=None if confidence[0] is None else torch.stack(confidence),
        )

    def block_logits(self, hidden: Tensor, previous: Tensor) -> tuple[Tensor, Tensor | None]:
        """Markov-corrected logits ``[k, V]`` and confidence logits ``[k]`` (or None) of the slots
        ``hidden [k, H]`` given each slot's previous token ``[k]``: the training module's heads, unchanged."""
        logits, confidence = self.draft.heads(hidden[None], previous[None].to(hidden.device))
        return logits[0], None if confidence is None else confidence[0]


def load_served_draft(directory: Path, target: FrozenTarget) -> tuple[DSparkDraft, dict[str, Any]]:
    """The draft of an (already validated) export with the embedding / LM head it serves with, and its
    DSpark fields."""
    config, layout, fields = read_config(directory)
    if layout == "nemo":
        draft, _ = load_exported_draft(directory)
        return draft, fields
    draft = draft_from_config(config, fields["target_layer_ids"], fields)
    state = load_file(str(directory / WEIGHTS_FILE))
    draft.to(next(iter(state.values())).dtype)
    missing, unexpected = draft.load_state_dict(state, strict=False)
    if sorted(missing) != sorted(TARGET_COPIES) or unexpected:
        raise ValueError(
            f"{directory / WEIGHTS_FILE} does not fit its config: missing {sorted(missing)}, unexpected "
            f"{sorted(unexpected)}; run validate_dspark_export for the details"
        )
    # After the dtype cast, so the target's own modules keep their dtype.
    draft.embed_tokens = target.input_embeddings
    draft.lm_head = target.lm_head
    return draft, fields


def load_speculator(directory: Path, target: FrozenTarget, num_steps: int) -> DSparkSpeculator:
    """The speculator of an (already validated) export, on the target's device."""
    draft, fields = load_served_draft(directory, target)
    draft.to(target.lm_head.weight.device).eval().requires_grad_(False)
    return DSparkSpeculator(draft, fields, target.num_layers, num_steps)


def load_training_module(directory: Path, target: FrozenTarget, num_steps: int) -> DSparkModule:
    """The module the export came from, sharing ``target``'s model, with the exported weights.

    Its chains cover the whole block (training's tau_sim); the report keeps the first ``num_steps``
    positions of each, over the same blocks. Loss weights only change the loss, not
    the chains; they are taken from the export's record where it has one.
    """
    config, _, fields = read_config(directory)
    record = config.get("lightning_drafts") or {}
    confidence_alpha = (
        (record.get("confidence_head_alpha") or 1.0) if fields["enable_confidence_head"] else 0.0
    )
    module = DSparkModule(
        target.model,
        **module_arguments(config, fields, target),
        markov_rank=fields["markov_rank"],
        markov_head_type=fields["markov_head_type"],
        confidence_head_alpha=confidence_alpha,
        confidence_head_with_markov=fields["confidence_head_with_markov"],
        ce_loss_alpha=record.get("ce_loss_alpha", 0.1),
        l1_loss_alpha=record.get("l1_loss_alpha", 0.9),
        loss_decay_gamma=record.get("loss_decay_gamma", 4.0),
    )
    module.load_exported(directory)
    return module


def default_num_steps(config: dict[str, Any]) -> int:
    """Every slot of a block: ``block_size`` (slot 0 proposes too, unlike DFlash)."""
    return int(config["block_size"])
