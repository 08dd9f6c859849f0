"""Serving export of DFlash / DFlash2 drafts: the layout vLLM's ``dflash`` method and SGLang load.

A directory with ``config.json`` and ``model.safetensors`` (docs/concepts/dflash.md#serving-layout):

* weights: ``layers.N.*``, ``fc.weight``, ``hidden_norm.weight``, ``norm.weight`` (DFlash2 adds
  ``layers.N.attention_conv.*``, ``layers.N.mlp_conv.*`` and ``candidate_selector.*``); no ``model.``
  prefix, no embedding, no LM head (servers reuse the target's);
* config: a Qwen3 config with ``architectures`` ``["DFlashDraftModel"]`` or ``["DFlash2DraftModel"]``,
  ``is_causal: false`` stamped explicitly (readers default sliding layers to causal), ``block_size``
  both at the top level (z-lab's reader) and in ``dflash_config`` (published drafters), with
  ``mask_token_id`` and ``target_layer_ids`` (+ the DFlash2 conv / selector fields).

Serving: vLLM ``--speculative-config '{"method": "dflash", "model": DIR, "num_speculative_tokens":
block_size - 1}'``; SGLang ``--speculative-algorithm DFLASH --speculative-draft-model-path DIR
--speculative-num-draft-tokens block_size``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import Qwen3Config

from lightning_drafts.blockdraft.config_fields import qwen3_serving_fields
from lightning_drafts.dflash.draft import DFlashDraft
from lightning_drafts.serving.export_files import write_export


def serving_config(
    draft_config: Qwen3Config,
    dflash_config: dict[str, Any],
    architecture: str,
    num_target_layers: int,
    target_record: dict[str, Any],
    dtype: torch.dtype,
) -> dict[str, Any]:
    """The ``config.json`` of a draft built from ``draft_config``."""
    config = qwen3_serving_fields(draft_config)
    config.update(
        architectures=[architecture],
        model_type="qwen3",
        is_causal=False,
        num_target_layers=num_target_layers,
        block_size=dflash_config["block_size"],
        dflash_config=dflash_config,
        torch_dtype=str(dtype).removeprefix("torch."),
        lightning_drafts=target_record,
    )
    return config


def export_draft(
    draft: DFlashDraft,
    output_dir: Path,
    dflash_config: dict[str, Any],
    architecture: str,
    num_target_layers: int,
    target_record: dict[str, Any],
    dtype: torch.dtype | None = None,
) -> Path:
    """Write ``draft`` to ``output_dir`` (all or nothing), in ``dtype`` (default: the draft's own)."""
    state = draft.state_dict()
    dtype = dtype or next(iter(state.values())).dtype
    tensors = {key: value.to(dtype) for key, value in state.items()}
    config = serving_config(
        draft.config, dflash_config, architecture, num_target_layers, target_record, dtype
    )
    return write_export(output_dir, config, tensors)
