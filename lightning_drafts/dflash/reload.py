"""Read a DFlash / DFlash2 export back: the draft network alone, or its weights into a module."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from safetensors.torch import load_file

from lightning_drafts.dflash.draft import DFlashDraft
from lightning_drafts.dflash.layout import draft_from_config, read_config
from lightning_drafts.serving.export_files import WEIGHTS_FILE


def load_exported_draft(path: str | Path) -> tuple[DFlashDraft, dict[str, Any]]:
    """Rebuild the draft network of an export (weights loaded strictly) and return it with its config."""
    path = Path(path)
    config = read_config(path)
    draft = draft_from_config(config)
    state = load_file(str(path / WEIGHTS_FILE))
    dtype = next(iter(state.values())).dtype
    draft.to(dtype).load_state_dict(state, strict=True)
    return draft, config


def load_into_module(
    draft: DFlashDraft, path: Path, architecture: str, dflash_config: dict[str, Any]
) -> None:
    """Load an export's weights into ``draft`` after checking it was made for this ``architecture`` and
    ``dflash_config``."""
    config = read_config(path)
    if config["architectures"][0] != architecture or config["dflash_config"] != dflash_config:
        raise ValueError(
            f"{path} holds a {config['architectures'][0]} with dflash_config {config['dflash_config']}, but this "
            f"module is a {architecture} with {dflash_config}; build the module with matching "
            "block_size, mask_token_id, target_layer_ids (and conv / selector sizes)"
        )
    state = load_file(str(path / WEIGHTS_FILE))
    reference = draft.state_dict()
    draft.load_state_dict({k: v.to(reference[k].dtype) if k in reference else v for k, v in state.items()})
