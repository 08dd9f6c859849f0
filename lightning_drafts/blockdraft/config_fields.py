"""What the exports of Qwen3-shaped block drafts share: the Qwen3 fields of ``config.json``, the config
a reader builds from them, and the rules every such export must meet (shape fields, RoPE, the target)."""

from __future__ import annotations

from typing import Any

from transformers import Qwen3Config

from lightning_drafts.blockdraft.draft import FOREIGN_ROPE_FIELDS
from lightning_drafts.core.checks import is_int
from lightning_drafts.serving.export_files import DefectList
from lightning_drafts.training.target import FrozenTarget

QWEN3_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "initializer_range",
    "rms_norm_eps",
    "rope_parameters",
    "attention_bias",
    "tie_word_embeddings",
    "layer_types",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
)
# Without these an engine would build the draft from its own defaults, not from what was trained.
REQUIRED_SHAPE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "max_position_embeddings",
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


def check_shape_fields(config: dict[str, Any], defects: DefectList) -> None:
    for name in REQUIRED_SHAPE_FIELDS:
        if config.get(name) is None:
            defects.add(
                name, "missing from config.json; the engine builds the draft from it (re-export the draft)"
            )
    for name in REQUIRED_SHAPE_FIELDS:
        value = config.get(name)
        if (
            name not in ("hidden_act", "rms_norm_eps")
            and value is not None
            and not (is_int(value) and value > 0)
        ):
            defects.add(name, f"is {value!r}; it must be a positive int")


def check_rope(config: dict[str, Any], defects: DefectList) -> None:
    theta = config.get("rope_theta")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
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


def check_against_target(config: dict[str, Any], defects: DefectList, target: FrozenTarget | None) -> None:
    if target is None:
        return
    # The draft embeds with the target's embedding and reads logits with its LM head.
    expected = {"vocab_size": target.vocab_size, "hidden_size": target.text_config.hidden_size}
    for name, value in expected.items():
        if name in config and config[name] != value:
            defects.add(
                name,
                f"is {config[name]} but the target has {value}; the draft reuses the target's embedding and "
                "LM head, so it was made for another target",
            )
