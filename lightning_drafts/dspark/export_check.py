"""The DSpark export validator: both export layouts (docs/concepts/dspark.md#serving-layout), checked as their
readers read them.

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
  agree; both loaders build all three Markov heads (vanilla, gated, rnn);
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

from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_drafts.blockdraft.config_fields import (
    check_block_draft_config,
    check_not_causal,
    config_section,
    summary_details,
)
from lightning_drafts.core.checks import is_int
from lightning_drafts.dspark.layout import HEAD_FIELDS, LAYOUTS, TARGET_COPIES, draft_from_config
from lightning_drafts.dspark.rules import (
    BLOCK_SIZE,
    CONFIDENCE_HEAD_WITH_MARKOV,
    MARKOV_HEAD_TYPE,
    MARKOV_RANK,
    TARGET_LAYER_IDS,
)
from lightning_drafts.serving.export_files import (
    DefectList,
    ExportFiles,
    ExportSummary,
    check_built_weights,
    open_export,
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
    files, architecture = open_export(directory, LAYOUT_OF, "a DSpark")
    config = files.config
    layout = LAYOUT_OF[architecture]
    defects = DefectList(files.directory)
    section, prefix = _dspark_section(config, layout, defects)
    layers = check_block_draft_config(
        config, section, prefix, defects, target, "DSpark", TARGET_LAYER_IDS, depth_required=True
    )
    _check_attention_fields(config, section, layout, defects)
    BLOCK_SIZE.report_field(defects, config)
    heads = _check_heads(config, section, layout, defects)
    defects.raise_if_any()

    layer_ids = section["target_layer_ids"]
    build = partial(draft_from_config, config, layer_ids, heads)
    not_shipped = TARGET_COPIES if layout == "specforge" else ()
    check_built_weights(files, build, architecture, defects, _confidence_bias_still_initial, not_shipped)
    if layout == "nemo" and target is not None:
        _check_target_copies(files, target, defects)
    defects.raise_if_any()
    return ExportSummary(
        architecture=architecture,
        target_layer_ids=tuple(layer_ids),
        layer_id_convention=LAYER_ID_CONVENTION,
        details={
            "layout": layout,
            **summary_details(config, section),
            **heads,
            "sglang_capturable_layer_ids": all(0 <= i < layers - 1 for i in layer_ids),
        },
    )


# --- config checks ----------------------------------------------------------------------------------


def _dspark_section(config: dict[str, Any], layout: str, defects: DefectList) -> tuple[dict[str, Any], str]:
    """The dict holding ``mask_token_id`` / ``target_layer_ids`` and the field-name prefix reporting it."""
    if layout == "nemo":
        return config, ""
    holds = (
        "SpecForge / SGLang read mask_token_id, target_layer_ids and the Markov / confidence settings from it"
    )
    return config_section(config, "dflash_config", defects, holds), "dflash_config."


def _check_attention_fields(
    config: dict[str, Any], section: dict[str, Any], layout: str, defects: DefectList
) -> None:
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
    check_not_causal(config, defects)
    for name, expected in (("projector_type", "dspark"), ("attention_mode", "gqa")):
        if section and section.get(name) != expected:
            defects.add(
                f"dflash_config.{name}",
                f"is {section.get(name)!r}; SpecForge builds a DSpark draft only from {expected!r}",
            )


def _check_heads(
    config: dict[str, Any], section: dict[str, Any], layout: str, defects: DefectList
) -> dict[str, Any]:
    """The Markov / confidence settings (read from the top level, as both loaders do)."""
    heads = {name: config.get(name) for name in HEAD_FIELDS}
    MARKOV_RANK.report_field(defects, heads)
    MARKOV_HEAD_TYPE.report_field(defects, heads)
    for name in ("enable_confidence_head", "confidence_head_with_markov"):
        if not isinstance(heads[name], bool):
            defects.add(name, f"is {heads[name]!r}; write true or false")
    CONFIDENCE_HEAD_WITH_MARKOV.report_field(
        defects, heads, confidence_head=heads["enable_confidence_head"], markov_rank=heads["markov_rank"]
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
