"""The DFlash / DFlash2 export validator: what vLLM's ``dflash`` method and SGLang read, checked as they read it.

``validate_dflash_export`` runs before every ``lightning-drafts evaluate`` of a DFlash export. The export
ships no embedding and no LM head (the draft reuses the target's), so what can go wrong is what ties the
draft to its target and to the decode layout:

* ``config.json``: the architecture; the shape fields the engine builds the draft from; RoPE
  (``rope_theta``, consistent ``rope_parameters``, no leaked ``partial_rotary_factor``); ``is_causal:
  false``; ``block_size`` at the top level (z-lab's reader) equal to ``dflash_config.block_size``
  (published drafters); ``dflash_config.mask_token_id`` inside the vocabulary and not a token the target
  emits as eos / pad / bos; ``dflash_config.target_layer_ids`` naming decoder-layer **outputs** (HF
  ``hidden_states[id + 1]``) inside the target; the DFlash2 conv / selector sizes;
* ``model.safetensors``: exactly the tensors of the draft that config describes, with its shapes; all
  finite; no matrix constant (zeroed or never written); the DFlash2 parts that start at a known value
  (identity conv kernels, zero kernel projections, zero successor codebook) moved off it; and not every
  RMSNorm gain still exactly 1 (a draft that never trained).

The layer-id convention is fixed by the format (every DFlash reader takes ``hidden_states[id + 1]``), so
it is reported, not read from the export.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_drafts.attention.block_masks import SLIDING_WINDOW
from lightning_drafts.blockdraft.config_fields import (
    check_block_draft_config,
    check_not_causal,
    config_section,
    summary_details,
)
from lightning_drafts.blockdraft.conv import CONV_GROUP_SIZE, CONV_KERNEL_SIZE
from lightning_drafts.dflash.layout import (
    ARCHITECTURES,
    DFLASH2_ARCHITECTURE,
    DFLASH2_FIELDS,
    draft_from_config,
)
from lightning_drafts.dflash.rules import BLOCK_SIZE, SELECTOR_RANK, SELECTOR_TOP_K, TARGET_LAYER_IDS
from lightning_drafts.serving.export_files import DefectList, ExportSummary, check_built_weights, open_export
from lightning_drafts.training.target import FrozenTarget

LAYER_ID_CONVENTION = "decoder-layer outputs, 0-based (HF hidden_states[id + 1])"
SECTION = "dflash_config."
# DFlash2 tensors whose initialisation is a fixed value; still equal to it means never trained.
ZERO_INITIALISED = ("kernel_projection.weight", "candidate_selector.successor_codebook")


def validate_dflash_export(directory: str | Path, target: FrozenTarget | None = None) -> ExportSummary:
    """Check a DFlash / DFlash2 export; one ``ValueError`` lists every defect, each naming its field.

    ``target`` adds the checks that need it: vocabulary, hidden size and layer count, and the mask token
    against the target's special tokens.
    """
    files, architecture = open_export(directory, ARCHITECTURES, "a DFlash")
    config = files.config
    defects = DefectList(files.directory)
    dflash_config = config_section(
        config,
        "dflash_config",
        defects,
        "write the dict of block_size, mask_token_id and target_layer_ids that serving engines read",
    )
    check_block_draft_config(
        config, dflash_config, SECTION, defects, target, "DFlash", TARGET_LAYER_IDS, depth_required=False
    )
    _check_attention_fields(config, defects)
    block_size = _check_block_size(config, dflash_config, defects)
    if architecture == DFLASH2_ARCHITECTURE:
        _check_dflash2_sizes(config, dflash_config, block_size, defects)
    defects.raise_if_any()

    build = partial(draft_from_config, config)
    check_built_weights(files, build, architecture, defects, _dflash2_part_still_initial)
    defects.raise_if_any()
    return ExportSummary(
        architecture=architecture,
        target_layer_ids=tuple(dflash_config["target_layer_ids"]),
        layer_id_convention=LAYER_ID_CONVENTION,
        details={
            **summary_details(config, dflash_config),
            "sliding_window": config.get("sliding_window") if config.get("use_sliding_window") else None,
            **{name: dflash_config.get(name) for name in DFLASH2_FIELDS if name in dflash_config},
        },
    )


# --- config checks ----------------------------------------------------------------------------------


def _check_attention_fields(config: dict[str, Any], defects: DefectList) -> None:
    check_not_causal(config, defects, ", and readers default sliding layers to causal")
    layer_types = config.get("layer_types")
    layers = config.get("num_hidden_layers")
    if layer_types is not None and (not isinstance(layer_types, list) or len(layer_types) != layers):
        defects.add("layer_types", f"is {layer_types!r}; write one entry per layer ({layers} layers)")
    if config.get("use_sliding_window"):
        SLIDING_WINDOW.report_field(defects, config)


def _check_block_size(
    config: dict[str, Any], dflash_config: dict[str, Any], defects: DefectList
) -> int | None:
    block_size = dflash_config.get("block_size")
    if not BLOCK_SIZE.report_field(defects, dflash_config, SECTION):
        return None
    if config.get("block_size") != block_size:
        defects.add(
            "block_size",
            f"is {config.get('block_size')!r} at the top level but dflash_config.block_size is {block_size}; "
            "z-lab's reader takes the top level, published drafters the dflash_config: write both, equal",
        )
    return block_size


def _check_dflash2_sizes(
    config: dict[str, Any], dflash_config: dict[str, Any], block_size: int | None, defects: DefectList
) -> None:
    CONV_KERNEL_SIZE.report_field(defects, dflash_config, SECTION, block_size=block_size)
    CONV_GROUP_SIZE.report_field(defects, dflash_config, SECTION, hidden_size=config.get("hidden_size"))
    SELECTOR_RANK.report_field(defects, dflash_config, SECTION)
    SELECTOR_TOP_K.report_field(defects, dflash_config, SECTION, vocab_size=config.get("vocab_size"))


# --- tensor checks ----------------------------------------------------------------------------------


def _dflash2_part_still_initial(name: str, tensor: Tensor) -> str | None:
    if name.endswith(ZERO_INITIALISED) and not bool(tensor.any()):
        return (
            "is still all zeros, its initialisation: that DFlash2 part was never trained or not saved "
            "(a selector_loss_weight of 0 leaves the selector untrained: serve such a draft as DFlash)"
        )
    if name.endswith("base_kernel") and _is_identity_kernel(tensor):
        return "is still the identity kernel it starts from: the in-block conv was never trained"
    return None


def _is_identity_kernel(kernel: Tensor) -> bool:
    identity = torch.zeros_like(kernel)
    identity[:, 0] = 1
    return bool(torch.equal(kernel, identity))
