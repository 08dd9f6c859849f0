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

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_drafts.blockdraft.config_fields import check_against_target, check_rope, check_shape_fields
from lightning_drafts.core.checks import is_int
from lightning_drafts.dflash.layout import (
    ARCHITECTURES,
    DFLASH2_ARCHITECTURE,
    DFLASH2_FIELDS,
    draft_from_serving_config,
)
from lightning_drafts.serving.export_files import (
    CONFIG_FILE,
    DefectList,
    ExportFiles,
    ExportSummary,
    architecture_of,
    check_tensor_layout,
    check_trained_tensors,
    read_export,
)
from lightning_drafts.training.target import FrozenTarget

LAYER_ID_CONVENTION = "decoder-layer outputs, 0-based (HF hidden_states[id + 1])"
# DFlash2 tensors whose initialisation is a fixed value; still equal to it means never trained.
ZERO_INITIALISED = ("kernel_projection.weight", "candidate_selector.successor_codebook")


def validate_dflash_export(directory: str | Path, target: FrozenTarget | None = None) -> ExportSummary:
    """Check a DFlash / DFlash2 export; one ``ValueError`` lists every defect, each naming its field.

    ``target`` adds the checks that need it: vocabulary, hidden size and layer count, and the mask token
    against the target's special tokens.
    """
    files = read_export(directory)
    config = files.config
    architecture = architecture_of(config, files.directory)
    if architecture not in ARCHITECTURES:
        raise ValueError(
            f"{files.directory / CONFIG_FILE}: architectures[0] = {architecture!r} is not a DFlash layout "
            f"({sorted(ARCHITECTURES)})"
        )
    defects = DefectList(files.directory)
    dflash_config = _dflash_config(config, defects)
    check_shape_fields(config, defects)
    _check_attention_fields(config, defects)
    check_rope(config, defects)
    block_size = _check_block_size(config, dflash_config, defects)
    mask_token_id = _check_mask_token(config, dflash_config, defects, target)
    layer_ids = _check_layer_ids(config, dflash_config, defects, target)
    if architecture == DFLASH2_ARCHITECTURE:
        _check_dflash2_sizes(config, dflash_config, block_size, defects)
    check_against_target(config, defects, target)
    defects.raise_if_any()

    _check_tensor_layout(files, architecture, defects)
    defects.raise_if_any()
    check_trained_tensors(files, defects, _dflash2_part_still_initial)
    defects.raise_if_any()
    return ExportSummary(
        architecture=architecture,
        target_layer_ids=tuple(layer_ids),
        layer_id_convention=LAYER_ID_CONVENTION,
        details={
            "block_size": block_size,
            "mask_token_id": mask_token_id,
            "vocab_size": config["vocab_size"],
            "rope_theta": config["rope_theta"],
            "sliding_window": config.get("sliding_window") if config.get("use_sliding_window") else None,
            **{name: dflash_config.get(name) for name in DFLASH2_FIELDS if name in dflash_config},
        },
    )


# --- config checks ----------------------------------------------------------------------------------


def _dflash_config(config: dict[str, Any], defects: DefectList) -> dict[str, Any]:
    dflash_config = config.get("dflash_config")
    if not isinstance(dflash_config, dict):
        defects.add(
            "dflash_config",
            f"is {dflash_config!r}; write the dict of block_size, mask_token_id and target_layer_ids that "
            "serving engines read (re-export the draft)",
        )
        return {}
    return dflash_config


def _check_attention_fields(config: dict[str, Any], defects: DefectList) -> None:
    if config.get("model_type") != "qwen3":
        defects.add(
            "model_type",
            f"is {config.get('model_type')!r}; DFlash drafts are Qwen3-style layers and readers dispatch on "
            "model_type 'qwen3'",
        )
    if config.get("is_causal") is not False:
        defects.add(
            "is_causal",
            f"is {config.get('is_causal')!r}; write false explicitly: the block attends both ways, and "
            "readers default sliding layers to causal",
        )
    layer_types = config.get("layer_types")
    layers = config.get("num_hidden_layers")
    if layer_types is not None and (not isinstance(layer_types, list) or len(layer_types) != layers):
        defects.add("layer_types", f"is {layer_types!r}; write one entry per layer ({layers} layers)")
    if config.get("use_sliding_window") and not (
        is_int(config.get("sliding_window")) and config["sliding_window"] > 0
    ):
        defects.add(
            "sliding_window",
            f"is {config.get('sliding_window')!r} while use_sliding_window is true; write the window length",
        )


def _check_block_size(config: dict[str, Any], dflash_config: dict[str, Any], defects: DefectList) -> int:
    block_size = dflash_config.get("block_size")
    if not (is_int(block_size) and block_size >= 2):
        defects.add(
            "dflash_config.block_size",
            f"is {block_size!r}; write the block size the draft trained with (an int >= 2: the anchor plus "
            "the drafted slots)",
        )
        return 0
    if config.get("block_size") != block_size:
        defects.add(
            "block_size",
            f"is {config.get('block_size')!r} at the top level but dflash_config.block_size is {block_size}; "
            "z-lab's reader takes the top level, published drafters the dflash_config: write both, equal",
        )
    return block_size


def _check_mask_token(
    config: dict[str, Any], dflash_config: dict[str, Any], defects: DefectList, target: FrozenTarget | None
) -> int | None:
    mask = dflash_config.get("mask_token_id")
    vocab = target.vocab_size if target is not None else config.get("vocab_size")
    if not is_int(mask) or (is_int(vocab) and not 0 <= mask < vocab):
        defects.add(
            "dflash_config.mask_token_id",
            f"is {mask!r}; write the reserved token id the draft trained with, inside the vocabulary "
            f"[0, {vocab})",
        )
        return None
    if target is not None:
        special = target.special_token_ids()
        if mask in special:
            defects.add(
                "dflash_config.mask_token_id",
                f"is {mask}, the target's {special[mask]} token; the mask must be a reserved id the target "
                "never emits (e.g. 151669 for Qwen3), or drafted blocks read as real text",
            )
    return mask


def _check_layer_ids(
    config: dict[str, Any], dflash_config: dict[str, Any], defects: DefectList, target: FrozenTarget | None
) -> list[int]:
    ids = dflash_config.get("target_layer_ids")
    if not isinstance(ids, list) or not ids or not all(is_int(i) and i >= 0 for i in ids):
        defects.add(
            "dflash_config.target_layer_ids",
            f"is {ids!r}; write the non-empty list of target decoder layers the draft's fc reads, in its "
            "column order (outputs, HF hidden_states[id + 1])",
        )
        return []
    recorded = config.get("num_target_layers")
    layers = target.num_layers if target is not None else recorded
    if target is not None and recorded is not None and recorded != target.num_layers:
        defects.add(
            "num_target_layers",
            f"is {recorded} but the target has {target.num_layers} decoder layers; the draft was made for "
            "another target",
        )
    if is_int(layers) and any(i >= layers for i in ids):
        defects.add(
            "dflash_config.target_layer_ids",
            f"{ids} names layers outside the target's {layers} decoder layers (valid outputs: "
            f"0..{layers - 1}); ids are layer outputs, not HF hidden_states indices (no +1)",
        )
    return list(ids)


def _check_dflash2_sizes(
    config: dict[str, Any], dflash_config: dict[str, Any], block_size: int, defects: DefectList
) -> None:
    for name in DFLASH2_FIELDS:
        value = dflash_config.get(name)
        if not (is_int(value) and value >= 1):
            defects.add(f"dflash_config.{name}", f"is {value!r}; DFlash2 needs it as a positive int")
    kernel, group = dflash_config.get("conv_kernel_size"), dflash_config.get("conv_group_size")
    hidden, vocab = config.get("hidden_size"), config.get("vocab_size")
    if is_int(kernel) and block_size and kernel > block_size:
        defects.add(
            "dflash_config.conv_kernel_size",
            f"is {kernel}, more than block_size {block_size}; taps past the block start read only zeros",
        )
    if is_int(group) and group >= 1 and is_int(hidden) and hidden % group:
        defects.add("dflash_config.conv_group_size", f"is {group}; it must divide hidden_size {hidden}")
    top_k = dflash_config.get("selector_top_k")
    if is_int(top_k) and is_int(vocab) and top_k > vocab:
        defects.add("dflash_config.selector_top_k", f"is {top_k}, more than the vocabulary ({vocab} tokens)")


# --- tensor checks# --- tensor checks ----------------------------------------------------------------------------------


def _check_tensor_layout(files: ExportFiles, architecture: str, defects: DefectList) -> None:
    try:
        with torch.device("meta"):
            expected = draft_from_serving_config(files.config).state_dict()
    except (ValueError, TypeError, KeyError) as error:  # e.g. an unknown hidden_act or rope_type
        defects.add("config.json", f"does not describe a buildable {architecture} ({error})")
        return
    check_tensor_layout(files, expected, architecture, defects)


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
