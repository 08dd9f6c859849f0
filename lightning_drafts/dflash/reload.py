"""Read a DFlash / DFlash2 export back: the draft network alone, or its weights into a module."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors.torch import load_file

from lightning_drafts.dflash.draft import DFlashDraft
from lightning_drafts.dflash.layout import draft_from_config, read_config
from lightning_drafts.serving.export_files import WEIGHTS_FILE

if TYPE_CHECKING:
    from lightning_drafts.dflash.module import DFlashModule


def load_exported_draft(path: str | Path) -> tuple[DFlashDraft, dict[str, Any]]:
    """Rebuild the draft network of an export (weights loaded strictly) and return it with its config."""
    path = Path(path)
    config = read_config(path)
    draft = draft_from_config(config)
    state = load_file(str(path / WEIGHTS_FILE))
    dtype = next(iter(state.values())).dtype
    draft.to(dtype).load_state_dict(state, strict=True)
    return draft, config


def load_into_module(module: DFlashModule, path: Path) -> None:
    """Load an export's weights into ``module``'s draft after checking it was made for this setup."""
    config = read_config(path)
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
