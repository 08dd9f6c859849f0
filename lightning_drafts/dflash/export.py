"""Serving export of DFlash / DFlash2 drafts: the layout vLLM's ``dflash`` method and SGLang load.

A directory with ``config.json`` and ``model.safetensors`` (dflash.md §9):

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

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config

from lightning_drafts.dflash.draft import DFlash2Draft, DFlashDraft

if TYPE_CHECKING:
    from lightning_drafts.dflash.module import DFlashModule

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
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
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
DFLASH2_ARCHITECTURE = "DFlash2DraftModel"
ARCHITECTURES = {"DFlashDraftModel": DFlashDraft, DFLASH2_ARCHITECTURE: DFlash2Draft}


def qwen3_serving_fields(draft_config: Qwen3Config) -> dict[str, Any]:
    """The Qwen3 fields of a block draft's ``config.json`` (shared by DFlash and DSpark exports)."""
    config = {key: value for key, value in draft_config.to_dict().items() if key in QWEN3_FIELDS}
    rope = config["rope_parameters"]
    # Readers written for transformers 4 look for rope_theta / rope_scaling at the top level.
    config["rope_theta"] = rope["rope_theta"]
    if rope.get("rope_type", "default") != "default":
        config["rope_scaling"] = rope
    return config


def serving_config(module: DFlashModule, dtype: torch.dtype) -> dict[str, Any]:
    """The ``config.json`` of ``module``'s draft."""
    config = qwen3_serving_fields(module.draft.config)
    dflash_config = module.dflash_config()
    config.update(
        architectures=[module.architecture],
        model_type="qwen3",
        is_causal=False,
        num_target_layers=module.target.num_layers,
        block_size=dflash_config["block_size"],
        dflash_config=dflash_config,
        torch_dtype=str(dtype).removeprefix("torch."),
        lightning_drafts=module.target_record(),
    )
    return config


def export_draft(module: DFlashModule, output_dir: Path, dtype: torch.dtype | None = None) -> Path:
    """Write ``module``'s draft to ``output_dir`` and check that what was written reads back complete."""
    output_dir.mkdir(parents=True, exist_ok=True)
    state = module.draft.state_dict()
    dtype = dtype or next(iter(state.values())).dtype
    tensors = {key: value.detach().to("cpu", dtype).contiguous() for key, value in state.items()}
    save_file(tensors, str(output_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    (output_dir / CONFIG_FILE).write_text(json.dumps(serving_config(module, dtype), indent=2) + "\n")
    with safe_open(str(output_dir / WEIGHTS_FILE), framework="pt") as written:
        missing = sorted(set(tensors) - set(written.keys()))
    if missing:
        raise ValueError(f"the export to {output_dir} lost weights {missing[:5]}; check free disk space")
    return output_dir


def read_serving_config(path: Path) -> dict[str, Any]:
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise ValueError(f"{path} is not a DFlash export: {CONFIG_FILE} is missing")
    config = json.loads(config_path.read_text())
    architecture = (config.get("architectures") or [None])[0]
    if architecture not in ARCHITECTURES or "dflash_config" not in config:
        raise ValueError(
            f"{config_path} declares architectures {config.get('architectures')} without a usable dflash_config; "
            f"expected one of {sorted(ARCHITECTURES)}"
        )
    return config


def qwen3_config_of(config: dict[str, Any]) -> Qwen3Config:
    """The draft's Qwen3 config as a reader builds it from ``config.json`` (the fields it knows)."""
    return Qwen3Config(**{key: config[key] for key in QWEN3_FIELDS if key in config})


def draft_from_serving_config(config: dict[str, Any]) -> DFlashDraft:
    """The draft network ``config.json`` describes, with fresh weights (build under ``torch.device("meta")``
    to get names and shapes only)."""
    dflash_config = config["dflash_config"]
    qwen3 = qwen3_config_of(config)
    features = len(dflash_config["target_layer_ids"])
    if config["architectures"][0] == DFLASH2_ARCHITECTURE:
        return DFlash2Draft(
            qwen3,
            features,
            dflash_config["conv_kernel_size"],
            dflash_config["conv_group_size"],
            dflash_config["selector_rank"],
        )
    return DFlashDraft(qwen3, features)


def load_exported_draft(path: str | Path) -> tuple[DFlashDraft, dict[str, Any]]:
    """Rebuild the draft network of an export (weights loaded strictly) and return it with its config."""
    path = Path(path)
    config = read_serving_config(path)
    draft = draft_from_serving_config(config)
    state = load_file(str(path / WEIGHTS_FILE))
    dtype = next(iter(state.values())).dtype
    draft.to(dtype).load_state_dict(state, strict=True)
    return draft, config


def load_into_module(module: DFlashModule, path: Path) -> None:
    """Load an export's weights into ``module``'s draft after checking it was made for this setup."""
    config = read_serving_config(path)
    if config["architectures"][0] != module.architecture or config["dflash_config"] != module.dflash_config():
        raise ValueError(
            f"{path} holds a {config['architectures'][0]} with dflash_config {config['dflash_config']}, but this "
            f"module is a {module.architecture} with {module.dflash_config()}; build the module with matching "
            "block_size, mask_token_id, target_layer_ids (and conv / selector sizes)"
        )
    state = load_file(str(path / WEIGHTS_FILE))
    reference = module.draft.state_dict()
    module.draft.load_state_dict(
        {k: v.to(reference[k].dtype) if k in reference else v for k, v in state.items()}
    )
