"""DFlash / DFlash2 block drafting from an exported draft, as vLLM / SGLang run it (the evaluate plug-in).

Everything about the draft comes from the export: the network from ``config.json`` + ``model.safetensors``
(:func:`~lightning_drafts.dflash.reload.load_exported_draft`), and ``block_size``, ``mask_token_id``,
``target_layer_ids`` (decoder-layer outputs, fused in the listed order) and, for DFlash2,
``selector_top_k`` from ``dflash_config``. The export ships no embedding and no LM head: like an engine,
the speculator embeds with the target's embedding and reads logits with the target's LM head.

One proposal from a verified prefix ``x_0 .. x_{L-1}`` (the last token, the previous round's bonus token,
has no target features yet), in the training frame of docs/concepts/dflash.md#the-draft and
docs/concepts/dflash.md#block-attention:

* the block is ``[x_{L-1}, MASK, ..., MASK]``: the anchor (the last verified token) and ``num_steps``
  mask slots, at RoPE positions ``L-1 .. L-1+num_steps``. With the default ``num_steps = block_size - 1``
  this is the trained block (the reference decode's, docs/concepts/dflash.md#decoding); asked for fewer
  tokens, the block is shortened rather than drafted whole and cut, because that is what vLLM serves (its
  DFlash and DFlash2 drafters query the bonus token and ``num_speculative_tokens`` mask tokens, nothing more),
  and the two-way in-block attention makes the two differ;
* the context is the fused target features of ``x_0 .. x_{L-2}``, every one strictly before the anchor (the
  training mask's ``kv < anchor``), narrowed to ``(L-1 + i) - kv < sliding_window`` for slot ``i`` when the
  draft has a window; the block attends to itself both ways;
* slot ``k >= 1`` drafts the token at ``L-1+k``. DFlash proposes each slot's argmax; DFlash2 proposes the
  greedy path of its pairwise selector over each slot's top-``selector_top_k`` candidates, starting from the
  anchor (the walk training logs as ``greedy_accept_len``).

No KV cache: the context is re-encoded each round, which gives the keys an engine would have cached.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_drafts.blockdraft.config_fields import module_arguments
from lightning_drafts.dflash.dflash2_module import DFlash2Module
from lightning_drafts.dflash.draft import DFlash2Draft, DFlashDraft
from lightning_drafts.dflash.layout import DFLASH2_ARCHITECTURE, read_config
from lightning_drafts.dflash.module import DFlashModule
from lightning_drafts.dflash.reload import load_exported_draft
from lightning_drafts.serving.family import VerifiedPrefix
from lightning_drafts.training.target import FrozenTarget


@dataclass(frozen=True)
class DraftedBlock:
    """One drafted block: the proposal (target ids ``[num_steps]``), the logits of the drafted slots
    (``[num_steps, V]``, the target's LM head on the draft's final states) and those states."""

    tokens: Tensor
    logits: Tensor
    hidden: Tensor


class DFlashSpeculator:
    """Greedy block drafting with a DFlash / DFlash2 draft: one block of ``block_size`` slots per round.

    Args:
        draft: the draft network (as loaded from the export).
        config: the export's ``config.json``.
        target: the frozen target whose embedding and LM head the draft reuses.
        num_steps: tokens proposed per round, at most ``block_size - 1``: the mask slots of the block.
    """

    def __init__(
        self, draft: DFlashDraft, config: dict[str, Any], target: FrozenTarget, num_steps: int
    ) -> None:
        dflash_config = config["dflash_config"]
        self.block_size = int(dflash_config["block_size"])
        if not 1 <= num_steps <= self.block_size - 1:
            raise ValueError(
                f"num_steps = {num_steps} must be in [1, block_size - 1 = {self.block_size - 1}]: a DFlash "
                "draft proposes at most the masked slots of one block per round"
            )
        self.draft = draft
        self.target = target
        self.num_steps = num_steps
        self.mask_token_id = int(dflash_config["mask_token_id"])
        self.target_layer_ids = tuple(int(i) for i in dflash_config["target_layer_ids"])
        self.sliding_window = config.get("sliding_window") if config.get("use_sliding_window") else None
        self.top_k = int(dflash_config["selector_top_k"]) if isinstance(draft, DFlash2Draft) else None

    def propose(self, prefix: VerifiedPrefix) -> Tensor:
        return self.draft_block(prefix).tokens

    @torch.no_grad()
    def draft_block(self, prefix: VerifiedPrefix) -> DraftedBlock:
        """The block drafted after ``prefix`` (its last token is the anchor): ``num_steps`` mask slots."""
        device = self.draft.fc.weight.device
        context = prefix.tokens.numel() - 1
        slots = self.num_steps + 1
        features = torch.cat(prefix.hidden_states, dim=-1).to(device)
        anchor = prefix.tokens[-1:].to(device)
        block = torch.cat([anchor, anchor.new_full((slots - 1,), self.mask_token_id)])
        offsets = torch.arange(slots, device=device)
        hidden = self.draft(
            features,
            torch.arange(context, device=device),
            self.target.input_embeddings(block.to(self.target.lm_head.weight.device)).to(device)[None],
            (context + offsets)[None],
            self._mask(context, slots, device),
        )[0, 1:]
        logits = self._logits(hidden)
        tokens = self._pick(hidden, logits, anchor)
        return DraftedBlock(tokens.to(prefix.tokens.device), logits, hidden)

    def _mask(self, context: int, slots: int, device: torch.device) -> Tensor:
        """``[1, 1, slots, context + slots]``: all earlier context (within the window), own block."""
        offsets = torch.arange(slots, device=device)[:, None]
        keys = torch.arange(context, device=device)[None]
        visible = torch.ones(slots, context, dtype=torch.bool, device=device)
        if self.sliding_window is not None:
            visible = (context + offsets) - keys < self.sliding_window
        own = torch.ones(slots, slots, dtype=torch.bool, device=device)
        return torch.cat([visible, own], dim=1)[None, None]

    def _logits(self, hidden: Tensor) -> Tensor:
        head = self.target.lm_head
        return nn.functional.linear(hidden.to(head.weight.device, head.weight.dtype), head.weight, head.bias)

    def _pick(self, hidden: Tensor, logits: Tensor, anchor: Tensor) -> Tensor:
        if self.top_k is None:
            return logits.argmax(-1)
        # The selector's walk: slot k re-ranks its top-K given the pick at slot k - 1 (the anchor for k = 1).
        unary, candidates = logits.topk(self.top_k, dim=-1)
        selector = self.draft.candidate_selector
        return selector.greedy_walk(
            hidden[None], unary[None].to(hidden.device), candidates[None].to(hidden.device), anchor
        )[0]


def load_speculator(directory: Path, target: FrozenTarget, num_steps: int) -> DFlashSpeculator:
    """The speculator of an (already validated) export, on the target's device."""
    draft, config = load_exported_draft(directory)
    draft.to(target.lm_head.weight.device).eval().requires_grad_(False)
    return DFlashSpeculator(draft, config, target, num_steps)


def load_training_module(directory: Path, target: FrozenTarget, num_steps: int) -> DFlashModule:
    """The module the export came from, sharing ``target``'s model, with the exported weights.

    Its chains cover the whole block (training's tau_sim); the report keeps the first ``num_steps``
    positions of each, over the same blocks.
    """
    config = read_config(directory)
    module_class, extra = _variant_arguments(config)
    module = module_class(
        target.model,
        **module_arguments(config, config["dflash_config"], target),
        sliding_window=config.get("sliding_window") if config.get("use_sliding_window") else None,
        **extra,
    )
    module.load_exported(directory)
    return module


def _variant_arguments(config: dict[str, Any]) -> tuple[type[DFlashModule], dict[str, Any]]:
    if config["architectures"][0] != DFLASH2_ARCHITECTURE:
        return DFlashModule, {}
    dflash_config = config["dflash_config"]
    names = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
    return DFlash2Module, {name: dflash_config[name] for name in names}


def default_num_steps(config: dict[str, Any]) -> int:
    """Every masked slot of a block: ``block_size - 1`` (vLLM's ``num_speculative_tokens``)."""
    return int(config["dflash_config"]["block_size"]) - 1
