"""The names of DSpark's two serving layouts (SpecForge's ``DSparkDraftModel``, NeMo's
``Qwen3DSparkModel``), and the draft a reader builds from ``config.json``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lightning_drafts.blockdraft.config_fields import qwen3_config_of
from lightning_drafts.dspark.draft import DSparkDraft
from lightning_drafts.serving.export_files import CONFIG_FILE

LAYOUTS = {"nemo": "Qwen3DSparkModel", "specforge": "DSparkDraftModel"}
TARGET_COPIES = ("embed_tokens.weight", "lm_head.weight")
HEAD_FIELDS = ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")


def read_config(path: Path) -> tuple[dict[str, Any], str, dict[str, Any]]:
    """``config.json`` of a DSpark export, its layout, and its DSpark fields in one form."""
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise ValueError(f"{path} is not a DSpark export: {CONFIG_FILE} is missing")
    config = json.loads(config_path.read_text())
    architecture = (config.get("architectures") or [None])[0]
    layouts = {name: layout for layout, name in LAYOUTS.items()}
    if architecture not in layouts:
        raise ValueError(
            f"{config_path} declares architectures {config.get('architectures')}; a DSpark export declares one "
            f"of {sorted(layouts)}"
        )
    layout = layouts[architecture]
    nested = config if layout == "nemo" else config.get("dflash_config", {})
    fields = {"block_size": config["block_size"]}
    fields.update({name: nested[name] for name in ("mask_token_id", "target_layer_ids")})
    fields.update({name: config[name] for name in HEAD_FIELDS})
    return config, layout, fields


def draft_from_config(config: dict[str, Any], layer_ids: list[int], heads: dict[str, Any]) -> DSparkDraft:
    """The draft network ``config.json`` describes (its head fields in ``heads``), with fresh weights
    (build under ``torch.device("meta")`` to get names and shapes only)."""
    return DSparkDraft(
        qwen3_config_of(config),
        len(layer_ids),
        markov_rank=heads["markov_rank"],
        markov_head_type=heads["markov_head_type"],
        confidence_head=heads["enable_confidence_head"],
        confidence_head_with_markov=heads["confidence_head_with_markov"],
    )
