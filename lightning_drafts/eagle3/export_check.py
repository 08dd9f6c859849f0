"""The EAGLE-3 export validator, and the draft a serving engine builds from ``config.json`` alone.

``validate_eagle3_export`` runs on every ``lightning-drafts export`` before the export lands, and before
every ``lightning-drafts evaluate``. It checks what vLLM / SGLang read, in the form they read it:

* ``config.json``: the architecture, the shape fields the engine builds the draft from, the RoPE settings
  (``rope_theta``, ``rope_scaling``; for the MLA layout ``rope_interleave``, ``model_type``, and a
  ``rope_scaling`` under which vLLM rotates as the draft does), and the captured layers in
  both engine conventions (vLLM's top-level ``eagle_aux_hidden_state_layer_ids`` = layer *inputs*,
  SGLang's ``eagle_config.eagle_aux_hidden_state_layer_ids`` = layer *outputs*), consistent with each
  other and with the ids and convention the exporter recorded under ``lightning_drafts``;
* ``model.safetensors``: exactly the tensors the draft built from that config has, with its shapes; all
  finite; ``d2t`` (offsets, ``target = draft + d2t[draft]``) naming distinct in-vocabulary ids that
  ``t2d`` marks; ``embed_tokens.weight`` equal to the target's input embedding; ``lm_head.weight`` not
  degenerate and not bit-identical to its initialisation (when the exporter recorded its fingerprint).
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig

from lightning_drafts.core.checks import is_int, is_number
from lightning_drafts.eagle3.draft_base import Eagle3Draft
from lightning_drafts.eagle3.layout import (
    DENSE_ARCHITECTURE,
    INIT_CHECKED_TENSORS,
    MLA_ARCHITECTURE,
    MLA_MODEL_TYPE,
    bias_tensors,
)
from lightning_drafts.eagle3.llama_draft import LlamaDraftConfig, LlamaEagle3Draft
from lightning_drafts.eagle3.mla_draft import MLADraftConfig, MLAEagle3Draft
from lightning_drafts.eagle3.rope import (
    FrequencyTable,
    default_inverse_frequencies,
    llama_rope_table,
    vllm_deepseek_rope_scaling,
)
from lightning_drafts.eagle3.rules import TARGET_LAYER_IDS
from lightning_drafts.serving.export_files import (
    DefectList,
    ExportFiles,
    ExportSummary,
    architecture_of,
    check_target_sizes,
    check_tensor_shapes,
    is_constant,
    open_export,
    tensor_fingerprint,
)
from lightning_drafts.training.target import FrozenTarget

VLLM_LAYER_FIELD = "eagle_aux_hidden_state_layer_ids"
SGLANG_LAYER_FIELD = "eagle_config.eagle_aux_hidden_state_layer_ids"
RECORD = "lightning_drafts"
DRAFT_CONFIGS = {DENSE_ARCHITECTURE: LlamaDraftConfig, MLA_ARCHITECTURE: MLADraftConfig}
OPTIONAL_FIELDS = {"initializer_range": 0.02}
NULLABLE_FIELDS = ("rope_scaling", "q_lora_rank")


def validate_eagle3_export(directory: str | Path, target: FrozenTarget | None = None) -> ExportSummary:
    """Check an EAGLE-3 / MLA-EAGLE-3 export; one ``ValueError`` lists every defect, each naming its field.

    ``target`` adds the checks that need it: vocabulary and hidden sizes, layer ids in range, and the
    shipped embedding equal to the target's.
    """
    files, architecture = open_export(directory, DRAFT_CONFIGS, "an EAGLE-3")
    config = files.config
    defects = DefectList(files.directory)
    _check_shape_fields(config, architecture, defects)
    _check_rope(config, architecture, defects)
    layer_ids = _check_layer_ids(config, defects, target)
    _check_against_target(config, defects, target)
    defects.raise_if_any()

    _check_tensor_layout(files, architecture, defects)
    defects.raise_if_any()
    _check_vocab_mapping(files, defects)
    _check_trained_tensors(files, defects, target)
    defects.raise_if_any()
    return ExportSummary(
        architecture=architecture,
        target_layer_ids=tuple(layer_ids),
        layer_id_convention=config[RECORD]["layer_id_convention"],
        details={
            "draft_vocab_size": config["draft_vocab_size"],
            "vocab_size": config["vocab_size"],
            "rope_theta": config["rope_theta"],
            "rope_scaling": config["rope_scaling"],
            "ttt_length": config[RECORD].get("ttt_length"),
            # False where only vLLM serves the draft as trained (see layout.BIAS_READERS).
            "sglang_specforge_servable": not bias_tensors(files.shapes),
        },
    )


def served_layer_ids(config: dict[str, Any]) -> list[int]:
    """The captured layers as vLLM reads them, converted to decoder-layer outputs (0-based).

    vLLM's ``eagle_aux_hidden_state_layer_ids`` names the layer whose **input** it captures, i.e. the
    output of the layer before; the validator has checked it agrees with SGLang's field and the record.
    """
    return [int(i) - 1 for i in config[VLLM_LAYER_FIELD]]


def draft_from_config(config: dict[str, Any]) -> Eagle3Draft:
    """The draft network a serving engine builds from ``config.json`` (random weights, fp32).

    Every shape and the RoPE table come from the config fields, never from the target, so a field the
    export lost or rounded shows up as a different draft.
    """
    architecture = architecture_of(config, Path("."))
    config_class = DRAFT_CONFIGS.get(architecture)
    if config_class is None:
        raise ValueError(
            f"architectures[0] = {architecture!r} is not an EAGLE-3 layout ({sorted(DRAFT_CONFIGS)})"
        )
    missing = _missing_fields(config, config_class)
    if missing:
        raise ValueError(f"config.json lacks the draft fields {missing}; re-export the draft")
    values = {f.name: config.get(f.name, OPTIONAL_FIELDS.get(f.name)) for f in fields(config_class)}
    draft_config = config_class(**values)
    if architecture == MLA_ARCHITECTURE:
        return MLAEagle3Draft(draft_config)
    # A small table, always computed for real: transformers' RoPE initialisers copy to the CPU explicitly,
    # which a meta-device build (the validator's shape check) could not do.
    with torch.device("cpu"):
        rope = serving_rope_table(draft_config)
    return LlamaEagle3Draft(draft_config, rope)


def serving_rope_table(config: LlamaDraftConfig) -> FrequencyTable:
    """The dense draft's RoPE from ``rope_theta`` / ``rope_scaling`` as written in ``config.json``."""
    if config.rope_scaling is None:
        return FrequencyTable(default_inverse_frequencies(config.head_dim, config.rope_theta))
    hf_config = LlamaConfig(
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        rope_parameters={**config.rope_scaling, "rope_theta": config.rope_theta},
    )
    return llama_rope_table(hf_config)


# --- config checks ----------------------------------------------------------------------------------


def _missing_fields(config: dict[str, Any], config_class: type) -> list[str]:
    return [
        f.name
        for f in fields(config_class)
        if f.name not in OPTIONAL_FIELDS
        and (f.name not in config or (config[f.name] is None and f.name not in NULLABLE_FIELDS))
    ]


def _check_shape_fields(config: dict[str, Any], architecture: str, defects: DefectList) -> None:
    for name in _missing_fields(config, DRAFT_CONFIGS[architecture]):
        defects.add(
            name, "missing from config.json; the engine builds the draft from it (re-export the draft)"
        )
    if config.get("num_hidden_layers") != 1:
        defects.add(
            "num_hidden_layers",
            f"is {config.get('num_hidden_layers')!r}; an EAGLE-3 draft has exactly one layer and engines build "
            "as many as this says",
        )
    if architecture == MLA_ARCHITECTURE and config.get("model_type") != MLA_MODEL_TYPE:
        defects.add(
            "model_type",
            f"is {config.get('model_type')!r}; write {MLA_MODEL_TYPE!r}: vLLM builds its DeepSeek MTP model, not "
            f"{MLA_ARCHITECTURE}, for any deepseek_v3 draft config",
        )
    if config.get("tie_word_embeddings") is not False:
        defects.add(
            "tie_word_embeddings",
            f"is {config.get('tie_word_embeddings')!r}; it must be false (the draft LM head [V_d, H] is not the "
            "embedding [V, H])",
        )


def _check_rope(config: dict[str, Any], architecture: str, defects: DefectList) -> None:
    theta = config.get("rope_theta")
    if not (is_number(theta) and theta > 0):
        defects.add(
            "rope_theta", f"is {theta!r}; write the target's positive RoPE base (engines default to 10000)"
        )
    if "rope_scaling" not in config:
        defects.add("rope_scaling", "missing; write null for plain RoPE or the target's scaling dict")
    elif config["rope_scaling"] is not None and not isinstance(config["rope_scaling"], dict):
        defects.add("rope_scaling", f"is {config['rope_scaling']!r}; it must be null or a dict")
    elif architecture == DENSE_ARCHITECTURE and isinstance(config["rope_scaling"], dict):
        if "rope_type" not in config["rope_scaling"]:
            defects.add("rope_scaling.rope_type", "missing; engines cannot tell which scaling to apply")
    if architecture == MLA_ARCHITECTURE:
        _check_mla_rope(config, defects)


def _check_mla_rope(config: dict[str, Any], defects: DefectList) -> None:
    if config.get("rope_interleave") is not True:
        defects.add(
            "rope_interleave",
            f"is {config.get('rope_interleave')!r}; the MLA draft rotates adjacent pairs (2i, 2i+1): write true",
        )
    scaling, max_positions = config.get("rope_scaling"), config.get("max_position_embeddings")
    if (scaling is None or isinstance(scaling, dict)) and is_int(max_positions):
        served = vllm_deepseek_rope_scaling(scaling, max_positions)
        if scaling != served:
            defects.add(
                "rope_scaling",
                f"is {scaling!r}, under which vLLM's DeepSeek attention would rotate or scale differently from "
                f"the draft (YaRN ramp whenever set, mscale / mscale_all_dim magnitudes); write {json.dumps(served)}",
            )


def _check_layer_ids(config: dict[str, Any], defects: DefectList, target: FrozenTarget | None) -> list[int]:
    record = config.get(RECORD)
    if not isinstance(record, dict):
        defects.add(
            RECORD, "missing; the exporter records the training ids, their convention and the target there"
        )
        record = {}
    vllm = _id_list(config.get(VLLM_LAYER_FIELD), VLLM_LAYER_FIELD, defects)
    eagle_config = config.get("eagle_config") if isinstance(config.get("eagle_config"), dict) else {}
    sglang = _id_list(eagle_config.get("eagle_aux_hidden_state_layer_ids"), SGLANG_LAYER_FIELD, defects)
    trained = (
        _id_list(record.get("target_layer_ids"), f"{RECORD}.target_layer_ids", defects) if record else None
    )
    if record and not record.get("layer_id_convention"):
        defects.add(
            f"{RECORD}.layer_id_convention",
            "missing; record whether the ids name decoder-layer outputs or inputs",
        )
    if eagle_config and eagle_config.get("use_aux_hidden_state") is not True:
        defects.add(
            "eagle_config.use_aux_hidden_state", "must be true, or engines ignore the captured layers"
        )
    if vllm is not None and sglang is not None and vllm != [i + 1 for i in sglang]:
        defects.add(
            VLLM_LAYER_FIELD,
            f"is {vllm} but {SGLANG_LAYER_FIELD} is {sglang}: vLLM names the layer whose input it captures, so it "
            f"must be each SGLang id + 1 ({[i + 1 for i in sglang]}); an off-by-one here collapses acceptance",
        )
    if sglang is not None and trained is not None and sglang != trained:
        defects.add(
            SGLANG_LAYER_FIELD,
            f"is {sglang} but the draft was trained on layer outputs {trained} ({RECORD}.target_layer_ids)",
        )
    if sglang is not None and target is not None:
        TARGET_LAYER_IDS.report(defects, sglang, SGLANG_LAYER_FIELD, num_layers=target.num_layers)
    return sglang or []


def _id_list(value: Any, name: str, defects: DefectList) -> list[int] | None:
    """A copy of the captured layer ids, checked by :data:`~lightning_drafts.eagle3.rules.TARGET_LAYER_IDS`."""
    if value is None:
        defects.add(name, "missing; write the three captured layer ids")
        return None
    return list(value) if TARGET_LAYER_IDS.report(defects, value, name) else None


def _check_against_target(config: dict[str, Any], defects: DefectList, target: FrozenTarget | None) -> None:
    if target is not None:
        expected = {"vocab_size": target.vocab_size, "target_hidden_size": target.text_config.hidden_size}
        check_target_sizes(config, defects, expected, "the draft was made for another target")


# --- tensor checks ----------------------------------------------------------------------------------


def _check_tensor_layout(files: ExportFiles, architecture: str, defects: DefectList) -> None:
    with torch.device("meta"):
        expected = draft_from_config(files.config).state_dict()
    check_tensor_shapes(files, expected, architecture, defects)
    for name, dtype in (("d2t", torch.int64), ("t2d", torch.bool)):
        if name in files.dtypes and files.dtypes[name] != dtype:
            defects.add(name, f"has dtype {files.dtypes[name]}, expected {dtype}")


def _check_vocab_mapping(files: ExportFiles, defects: DefectList) -> None:
    d2t, t2d = files.tensor("d2t"), files.tensor("t2d")
    draft_size, vocab_size = d2t.numel(), t2d.numel()
    selected = torch.arange(draft_size) + d2t
    if (selected < 0).any() or (selected >= vocab_size).any():
        hint = ""
        if 0 <= int(d2t.min()) and int(d2t.max()) < vocab_size and bool(t2d[d2t].all()):
            hint = " (d2t looks like absolute target ids; engines read offsets: write selected - arange(V_d))"
        defects.add("d2t", f"maps draft ids to target ids outside [0, {vocab_size}){hint}")
        return
    if selected.unique().numel() != draft_size:
        defects.add("d2t", "maps two draft ids to the same target id; the mapping must be one to one")
    if int(t2d.sum()) != draft_size or not bool(t2d[selected].all()):
        defects.add(
            "t2d",
            f"marks {int(t2d.sum())} target ids but d2t selects {draft_size} others; rebuild both from one mapping",
        )


def _check_trained_tensors(files: ExportFiles, defects: DefectList, target: FrozenTarget | None) -> None:
    for name, dtype in files.dtypes.items():
        if dtype.is_floating_point and not bool(torch.isfinite(files.tensor(name)).all()):
            defects.add(name, "holds NaN or inf values")
    lm_head = files.tensor("lm_head.weight")
    if lm_head.numel() and is_constant(lm_head):
        defects.add("lm_head.weight", "is constant (e.g. all zeros): it was never trained or not saved")
    recorded = (files.config.get(RECORD) or {}).get("init_fingerprints") or {}
    for name in INIT_CHECKED_TENSORS:
        if name in recorded and tensor_fingerprint(files.tensor(name)) == recorded[name]:
            defects.add(
                name,
                "is bit-identical to its random initialisation: the draft was never trained or not saved",
            )
    if target is not None:
        embedding = files.tensor("embed_tokens.weight")
        expected = target.input_embeddings.weight.detach().to("cpu", embedding.dtype)
        if embedding.shape != expected.shape or not torch.equal(embedding, expected):
            defects.add(
                "embed_tokens.weight",
                "differs from the target's input embedding; the draft must ship the frozen copy it trained with",
            )
