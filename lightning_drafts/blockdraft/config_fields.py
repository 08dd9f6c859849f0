"""What the exports of Qwen3-shaped block drafts share: the Qwen3 fields of ``config.json``, the config
a reader builds from them, and the checks every such export must pass (shape fields, attention, RoPE,
the mask token, the target)."""

from __future__ import annotations

from typing import Any

from transformers import Qwen3Config

from lightning_drafts.blockdraft.draft import ATTENTION_OVERRIDES, FOREIGN_ROPE_FIELDS
from lightning_drafts.blockdraft.objective import ESTIMATE_ANCHORS
from lightning_drafts.core.checks import is_number
from lightning_drafts.core.rules import FieldRule, int_rule
from lightning_drafts.serving.export_files import DefectList, check_target_sizes
from lightning_drafts.training.hyperparameters import MASK_TOKEN_ID, special_token_names
from lightning_drafts.training.target import FrozenTarget

# Without these an engine would build the draft from its own defaults, not from what was trained.
SIZE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)
REQUIRED_SHAPE_FIELDS = (*SIZE_FIELDS, "hidden_act", "rms_norm_eps", "max_position_embeddings")
QWEN3_FIELDS = (
    *REQUIRED_SHAPE_FIELDS,
    "initializer_range",
    "rope_parameters",
    "attention_bias",
    "tie_word_embeddings",
    "layer_types",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
)
NUM_TARGET_LAYERS = int_rule(
    "num_target_layers", 1, hint="the target's decoder-layer count L the draft's layer ids refer to"
)


def qwen3_serving_fields(draft_config: Qwen3Config) -> dict[str, Any]:
    """The Qwen3 fields of a block draft's ``config.json`` (shared by DFlash and DSpark exports)."""
    config = {key: value for key, value in draft_config.to_dict().items() if key in QWEN3_FIELDS}
    rope = config["rope_parameters"]
    # Readers written for transformers 4 look for rope_theta / rope_scaling at the top level.
    config["rope_theta"] = rope["rope_theta"]
    if rope.get("rope_type", "default") != "default":
        config["rope_scaling"] = rope
    return config


def qwen3_config_of(config: dict[str, Any]) -> Qwen3Config:
    """The draft's Qwen3 config as a reader builds it from ``config.json`` (the fields it knows)."""
    return Qwen3Config(**{key: config[key] for key in QWEN3_FIELDS if key in config})


def module_arguments(config: dict[str, Any], fields: dict[str, Any], target: FrozenTarget) -> dict[str, Any]:
    """The arguments every block-draft module an export came from is rebuilt with, sharing ``target``
    (``fields``: the family's ``block_size`` / ``mask_token_id`` / ``target_layer_ids``, wherever its
    layout keeps them). Training's estimate reads many anchors per document."""
    return {
        "mask_token_id": fields["mask_token_id"],
        "target_layer_ids": fields["target_layer_ids"],
        "num_draft_layers": config["num_hidden_layers"],
        "block_size": fields["block_size"],
        "num_anchors": ESTIMATE_ANCHORS,
        "draft_overrides": {name: config[name] for name in ATTENTION_OVERRIDES},
        "target_attn_backend": target.requested_backend,
    }


def config_section(config: dict[str, Any], name: str, defects: DefectList, holds: str) -> dict[str, Any]:
    """The dict ``config[name]`` (``{}`` with a defect when it is not one; ``holds``: what readers take
    from it)."""
    section = config.get(name)
    if isinstance(section, dict):
        return section
    defects.add(name, f"is {section!r}; {holds} (re-export the draft)")
    return {}


def summary_details(config: dict[str, Any], section: dict[str, Any]) -> dict[str, Any]:
    """What every validated block-draft export tells the evaluator about its blocks, mask and RoPE."""
    return {
        "block_size": config["block_size"],
        "mask_token_id": section["mask_token_id"],
        "vocab_size": config["vocab_size"],
        "rope_theta": config["rope_theta"],
    }


def check_block_draft_config(
    config: dict[str, Any],
    section: dict[str, Any],
    prefix: str,
    defects: DefectList,
    target: FrozenTarget | None,
    family: str,
    layer_ids: FieldRule,
    depth_required: bool,
) -> Any:
    """What every Qwen3-shaped block-draft export must meet: the shape fields, ``model_type``, RoPE, the
    mask token and the family's ``layer_ids`` rule (``mask_token_id`` / ``target_layer_ids`` read from
    ``section``, reported under ``prefix``) against the target's depth, and the target's sizes. Returns
    that depth: the target's layer count, else the recorded ``num_target_layers``.

    ``depth_required``: the export must record ``num_target_layers`` (the family's ids depend on it).
    """
    _check_shape_fields(config, defects)
    _check_model_type(config, defects, family)
    _check_rope(config, defects)
    # Without a target, the vocabulary the draft was exported with.
    vocab_size = target.vocab_size if target is not None else config.get("vocab_size")
    special = special_token_names(target) if target is not None else {}
    MASK_TOKEN_ID.report_field(defects, section, prefix, vocab_size=vocab_size, special=special)
    depth = _target_depth(config, defects, target, depth_required)
    layer_ids.report_field(defects, section, prefix, num_layers=depth)
    _check_against_target(config, defects, target)
    return depth


def _check_shape_fields(config: dict[str, Any], defects: DefectList) -> None:
    for name in REQUIRED_SHAPE_FIELDS:
        if config.get(name) is None:
            defects.add(
                name, "missing from config.json; the engine builds the draft from it (re-export the draft)"
            )
    for name in (*SIZE_FIELDS, "max_position_embeddings"):
        if config.get(name) is not None:
            int_rule(name, 1).report_field(defects, config)


def _check_model_type(config: dict[str, Any], defects: DefectList, family: str) -> None:
    if config.get("model_type") != "qwen3":
        defects.add(
            "model_type",
            f"is {config.get('model_type')!r}; {family} drafts are Qwen3-style layers and readers dispatch on "
            "model_type 'qwen3'",
        )


def check_not_causal(config: dict[str, Any], defects: DefectList, why: str = "") -> None:
    if config.get("is_causal") is not False:
        defects.add(
            "is_causal",
            f"is {config.get('is_causal')!r}; write false explicitly: the block attends both ways{why}",
        )


def _check_rope(config: dict[str, Any], defects: DefectList) -> None:
    theta = config.get("rope_theta")
    if not (is_number(theta) and theta > 0):
        defects.add(
            "rope_theta",
            f"is {theta!r}; write the draft's positive RoPE base at the top level (readers written for "
            "transformers 4 look for it there and default to 10000)",
        )
    parameters = config.get("rope_parameters")
    if parameters is not None:
        if not isinstance(parameters, dict):
            defects.add("rope_parameters", f"is {parameters!r}; it must be a dict or absent")
        elif parameters.get("rope_theta", theta) != theta:
            defects.add(
                "rope_parameters.rope_theta",
                f"is {parameters.get('rope_theta')!r} but rope_theta is {theta!r}; readers pick one of the two",
            )
    for name in FOREIGN_ROPE_FIELDS:
        leaked = [
            where
            for where, section in (("", config), ("rope_parameters.", parameters))
            if isinstance(section, dict) and section.get(name) not in (None, 1.0)
        ]
        for where in leaked:
            defects.add(
                f"{where}{name}",
                "is set; a Qwen3 reader would build a narrower / sectioned rotary table than the draft trained "
                "with (drop the field)",
            )


def _target_depth(
    config: dict[str, Any], defects: DefectList, target: FrozenTarget | None, required: bool
) -> Any:
    """The target's decoder-layer count the exported layer ids are checked against: the target's, else
    the recorded ``num_target_layers`` (``required``: the export must record it)."""
    recorded = config.get("num_target_layers")
    recorded_ok = not required or NUM_TARGET_LAYERS.report(defects, recorded)
    if recorded_ok and target is not None and recorded is not None and recorded != target.num_layers:
        defects.add(
            "num_target_layers",
            f"is {recorded} but the target has {target.num_layers} decoder layers; the draft was made for "
            "another target",
        )
    return target.num_layers if target is not None else recorded


def _check_against_target(config: dict[str, Any], defects: DefectList, target: FrozenTarget | None) -> None:
    if target is None:
        return
    # The draft embeds with the target's embedding and reads logits with its LM head.
    expected = {"vocab_size": target.vocab_size, "hidden_size": target.text_config.hidden_size}
    why = "the draft reuses the target's embedding and LM head, so it was made for another target"
    check_target_sizes(config, defects, expected, why)
