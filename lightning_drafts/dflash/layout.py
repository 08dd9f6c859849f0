"""The names of the DFlash / DFlash2 serving layouts, and the draft a reader builds from ``config.json``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lightning_drafts.blockdraft.config_fields import qwen3_config_of
from lightning_drafts.dflash.draft import DFlash2Draft, DFlashDraft
from lightning_drafts.serving.export_files import CONFIG_FILE

DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
DFLASH2_ARCHITECTURE = "DFlash2DraftModel"
ARCHITECTURES = {"DFlashDraftModel": DFlashDraft, DFLASH2_ARCHITECTURE: DFlash2Draft}


def read_config(path: Path) -> dict[str, Any]:
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


def draft_from_config(config: dict[str, Any]) -> DFlashDraft:
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
