"""The DSpark export validator: both export layouts (dspark.md §13), checked as their readers read them.

``validate_dspark_export`` runs before every ``lightning-drafts evaluate`` of a DSpark export. The
SpecForge / SGLang ``DSparkDraftModel`` layout (the default) ships no embedding and no LM head (the
server reuses the target's); NeMo's ``Qwen3DSparkModel`` layout ships frozen copies of both. Checked:

* ``config.json``: the architecture; the Qwen3 shape fields the draft is built from; RoPE
  (``rope_theta``, consistent ``rope_parameters``, no leaked ``partial_rotary_factor``); full attention
  (no sliding window); ``block_size`` >= 1 (K proposals per block: slot k predicts ``anchor + k + 1``);
  ``mask_token_id`` inside the vocabulary and not an eos / pad / bos token; ``target_layer_ids`` strictly
  increasing feature ids inside the target (NeMo's offset-1 convention below); the Markov / confidence
  settings in range and buildable. Where they live depends on the layout: NeMo writes everything at the
  top level; SpecForge nests ``mask_token_id`` / ``target_layer_ids`` / the head settings under
  ``dflash_config`` (with ``projector_type: "dspark"``, ``attention_mode: "gqa"``, ``is_causal: false``)
  and repeats the head settings at the top level, where its ``DSparkConfig`` reads them, so the two must
  agree; SpecForge implements only the vanilla Markov head;
* ``model.safetensors``: exactly the tensors of the draft the config describes, with its shapes (e.g. a
  dropped ``fc.weight`` or ``markov_head.markov_w2.weight``); one dtype matching ``torch_dtype``; all
  finite; no matrix constant (zeroed or never written); not every RMSNorm gain still exactly 1 and no
  confidence-head bias still exactly 0 (their initial values: never trained); for the NeMo layout,
  embedding / LM-head copies that are the target's (a random or foreign head serves garbage).

Feature ids follow NeMo's HF ``output_hidden_states`` offset-1 convention, fixed by the format: ``-1`` =
embedding output, ``0 .. L - 2`` = decoder-layer outputs (``hidden_states[id + 1]``), ``L - 1`` = the
final-norm output. Standard SGLang captures only ``[0, L - 2]``; that is reported, not refused (NeMo
trains with the others and warns).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_drafts.blockdraft.config_fields import check_against_target, check_rope, check_shape_fields
from lightning_drafts.core.checks import is_int
from lightning_drafts.dspark.context_features import EMBEDDING_FEATURE
from lightning_drafts.dspark.layout import HEAD_FIELDS, LAYOUTS, TARGET_COPIES, draft_from_config
from lightning_drafts.dspark.markov_head import MARKOV_HEAD_TYPES
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

LAYER_ID_CONVENTION = (
    "NeMo offset-1 feature ids: -1 = embedding output, 0..L-2 = decoder-layer outputs "
    "(HF hidden_states[id + 1]), "
    "L-1 = final-norm output (hidden_states[L])"
)
LAYOUT_OF = {architecture: layout for layout, architecture in LAYOUTS.items()}
# A NeMo-layout copy further than this (relative Frobenius distance) from the target's is not a copy:
# fine-tuning an unfrozen copy moves it a few percent, a random init or another target's ~100%.
COPY_TOLERANCE = 0.5
CONFIDENCE_BIAS = "confidence_head.proj.bias"


def validate_dspark_export(directory: str | Path, target: FrozenTarget | None = None) -> ExportSummary:
    """Check a DSpark export (either layout); one ``ValueError`` lists every defect, each naming its field.

    ``target`` adds the checks that need it: vocabulary, hidden size and layer count, the mask token
    against the target's special tokens, and (NeMo layout) the shipped embedding / LM-head copies.
    """
    files = read_export(directory)
    config = files.config
    architecture = architecture_of(config, files.directory)
    if architecture not in LAYOUT_OF:
        raise ValueError(
            f"{files.directory / CONFIG_FILE}: architectures[0] = {architecture!r} is not a DSpark layout "
            f"({sorted(LAYOUT_OF)})"
        )
    layout = LAYOUT_OF[architecture]
    defects = DefectList(files.directory)
    section, prefix = _dspark_section(config, layout, defects)
    check_shape_fields(config, defects)
    _check_attention_fields(config, section, layout, defects)
    check_rope(config, defects)
    block_size = _check_block_size(config, defects)
    mask_token_id = _check_mask_token(config, section, prefix, defects, target)
    layer_ids = _check_layer_ids(config, section, prefix, defects, target)
    heads = _check_heads(config, section, layout, defects)
    check_against_target(config, defects, target)
    defects.raise_if_any()

    _check_tensor_layout(files, layout, layer_ids, heads, defects)
    defects.raise_if_any()
    check_trained_tensors(files, defects, _confidence_bias_still_initial)
    if layout == "nemo" and target is not None:
        _check_target_copies(files, target, defects)
    defects.raise_if_any()
    last = target.num_layers - 1 if target is not None else config["num_target_layers"] - 1
    return ExportSummary(
        architecture=architecture,
        target_layer_ids=tuple(layer_ids),
        layer_id_convention=LAYER_ID_CONVENTION,
        details={
            "layout": layout,
            "block_size": block_size,
            "mask_token_id": mask_token_id,
            "vocab_size": config["vocab_size"],
            "rope_theta": config["rope_theta"],
            **heads,
            "sglang_capturable_layer_ids": all(0 <= i < last for i in layer_ids),
        },
    )


# --- config checks ----------------------------------------------------------------------------------


def _dspark_section(config: dict[str, Any], layout: str, defects: DefectList) -> tuple[dict[str, Any], str]:
    """The dict holding ``mask_token_id`` / ``target_layer_ids`` and the field-name prefix reporting it."""
    if layout == "nemo":
        return config, ""
    section = config.get("dflash_config")
    if not isinstance(section, dict):
        defects.add(
            "dflash_config",
            f"is {section!r}; SpecForge / SGLang read mask_token_id, target_layer_ids and the Markov / "
            "confidence settings from it (re-export the draft)",
        )
        return {}, "dflash_config."
    return section, "dflash_config."


def _check_attention_fields(
    config: dict[str, Any], section: dict[str, Any], layout: str, defects: DefectList
) -> None:
    if config.get("model_type") != "qwen3":
        defects.add(
            "model_type",
            f"is {config.get('model_type')!r}; DSpark drafts are Qwen3-style layers and readers dispatch on "
            "model_type 'qwen3'",
        )
    layer_types, layers = config.get("layer_types"), config.get("num_hidden_layers")
    if layer_types is not None and layer_types != ["full_attention"] * (layers if is_int(layers) else 0):
        defects.add(
            "layer_types",
            f"is {layer_types!r}; DSpark trains full attention: write one 'full_attention' per layer",
        )
    if config.get("use_sliding_window"):
        defects.add(
            "use_sliding_window", "is true; a DSpark block attends to its whole context (write false)"
        )
    if layout != "specforge":
        return
    if config.get("is_causal") is not False:
        defects.add(
            "is_causal",
            f"is {config.get('is_causal')!r}; write false explicitly: the block attends both ways",
        )
    for name, expected in (("projector_type", "dspark"), ("attention_mode", "gqa")):
        if section and section.get(name) != expected:
            defects.add(
                f"dflash_config.{name}",
                f"is {section.get(name)!r}; SpecForge builds a DSpark draft only from {expected!r}",
            )


def _check_block_size(config: dict[str, Any], defects: DefectList) -> int:
    block_size = config.get("block_size")
    if not (is_int(block_size) and block_size >= 1):
        defects.add(
            "block_size",
            f"is {block_size!r}; write the block size K the draft trained with (an int >= 1: slot k proposes "
            "the token at anchor + k + 1)",
        )
        return 0
    return block_size


def _check_mask_token(
    config: dict[str, Any],
    section: dict[str, Any],
    prefix: str,
    defects: DefectList,
    target: FrozenTarget | None,
) -> int | None:
    mask = section.get("mask_token_id")
    vocab = target.vocab_size if target is not None else config.get("vocab_size")
    if not is_int(mask) or (is_int(vocab) and not 0 <= mask < vocab):
        defects.add(
            f"{prefix}mask_token_id",
            f"is {mask!r}; write the reserved token id the draft trained with, inside the vocabulary "
            f"[0, {vocab})",
        )
        return None
    special = target.special_token_ids() if target is not None else {}
    if mask in special:
        defects.add(
            f"{prefix}mask_token_id",
            f"is {mask}, the target's {special[mask]} token; the mask must be a reserved id the target never "
            "emits (e.g. 151669 for Qwen3), or drafted blocks read as real text",
        )
    return mask


def _check_layer_ids(
    config: dict[str, Any],
    section: dict[str, Any],
    prefix: str,
    defects: DefectList,
    target: FrozenTarget | None,
) -> list[int]:
    name = f"{prefix}target_layer_ids"
    ids = section.get("target_layer_ids")
    if not isinstance(ids, list) or not ids or not all(is_int(i) for i in ids):
        defects.add(
            name,
            f"is {ids!r}; write the non-empty list of target feature ids the draft's fc reads, in its column "
            "order (-1 = embedding output, L-1 = final-norm output, else decoder-layer outputs)",
        )
        return []
    if any(a >= b for a, b in zip(ids, ids[1:], strict=False)):
        defects.add(name, f"is {ids}; ids must be strictly increasing, the order fc was trained with")
    recorded = config.get("num_target_layers")
    if not is_int(recorded) or recorded < 1:
        defects.add(
            "num_target_layers",
            f"is {recorded!r}; write the target's decoder-layer count L (feature id L-1 = its final-norm "
            "output)",
        )
    elif target is not None and recorded != target.num_layers:
        defects.add(
            "num_target_layers",
            f"is {recorded} but the target has {target.num_layers} decoder layers; the draft was made for "
            "another target (and id L-1 would name another feature)",
        )
    layers = target.num_layers if target is not None else recorded
    if is_int(layers) and any(not EMBEDDING_FEATURE <= i <= layers - 1 for i in ids):
        defects.add(
            name,
            f"{ids} names features outside the target's {layers} decoder layers (valid: -1 = embedding "
            f"output, 0..{layers - 2} = decoder-layer outputs, {layers - 1} = final-norm output)",
        )
    return list(ids)


def _check_heads(
    config: dict[str, Any], section: dict[str, Any], layout: str, defects: DefectList
) -> dict[str, Any]:
    """The Markov / confidence settings (read from the top level, as both loaders do)."""
    heads = {name: config.get(name) for name in HEAD_FIELDS}
    rank, head_type = heads["markov_rank"], heads["markov_head_type"]
    if not (is_int(rank) and rank >= 0):
        defects.add("markov_rank", f"is {rank!r}; write the Markov head's rank r (an int >= 0, 0 = no head)")
    if head_type not in MARKOV_HEAD_TYPES:
        defects.add("markov_head_type", f"is {head_type!r}; write one of {list(MARKOV_HEAD_TYPES)}")
    elif layout == "specforge" and head_type != "vanilla":
        defects.add(
            "markov_head_type",
            f"is {head_type!r}; SpecForge's DSparkDraftModel implements only 'vanilla' "
            "(export layout='nemo')",
        )
    for name in ("enable_confidence_head", "confidence_head_with_markov"):
        if not isinstance(heads[name], bool):
            defects.add(name, f"is {heads[name]!r}; write true or false")
    if heads["enable_confidence_head"] is True and heads["confidence_head_with_markov"] is True and rank == 0:
        defects.add(
            "confidence_head_with_markov",
            "is true but markov_rank is 0: the confidence head would read a Markov latent that does not "
            "exist",
        )
    if layout == "specforge" and section:
        for name in HEAD_FIELDS:
            if section.get(name) != heads[name]:
                defects.add(
                    f"dflash_config.{name}",
                    f"is {section.get(name)!r} but the top-level {name} is {heads[name]!r}; readers take "
                    "one of the two: write both, equal",
                )
    return heads


# --- tensor checks ----------------------------------------------------------------------------------


def _check_tensor_layout(
    files: ExportFiles, layout: str, layer_ids: list[int], heads: dict[str, Any], defects: DefectList
) -> None:
    try:
        with torch.device("meta"):
            expected = draft_from_config(files.config, layer_ids, heads).state_dict()
    except (ValueError, TypeError, KeyError) as error:  # e.g. an unknown hidden_act or rope_type
        defects.add("config.json", f"does not describe a buildable DSpark draft ({error})")
        return
    if layout == "specforge":
        expected = {name: value for name, value in expected.items() if name not in TARGET_COPIES}
    architecture = LAYOUTS[layout]
    check_tensor_layout(files, expected, architecture, defects)


def _confidence_bias_still_initial(name: str, tensor: Tensor) -> str | None:
    if name == CONFIDENCE_BIAS and not bool(tensor.any()):
        return "is still exactly 0, its initialisation: the confidence head was never trained or not saved"
    return None


def _check_target_copies(files: ExportFiles, target: FrozenTarget, defects: DefectList) -> None:
    """NeMo's layout serves with its own embedding / LM head, which start as copies of the target's."""
    references = {
        "embed_tokens.weight": target.input_embeddings.weight,
        "lm_head.weight": target.lm_head.weight,
    }
    for name, reference in references.items():
        if files.shapes.get(name) != tuple(reference.shape):
            continue  # a shape mismatch is already reported against the target's sizes
        distance = _relative_distance(files.tensor(name), reference)
        if distance > COPY_TOLERANCE:
            defects.add(
                name,
                f"is not the target's (relative distance {distance:.2f}): a random init or another target's "
                "copy; export from a DSparkModule built on this target",
            )


def _relative_distance(tensor: Tensor, reference: Tensor) -> float:
    reference = reference.detach().to("cpu", torch.float32)
    return float((tensor.float() - reference).norm() / reference.norm().clamp(min=1e-12))
