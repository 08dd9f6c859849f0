"""Export a trained draft checkpoint in the layout its serving engine loads."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import torch

from lightning_drafts.base import DraftModule


def load_draft_checkpoint(checkpoint_path: str | Path, target: str | None = None) -> DraftModule:
    """Rebuild the draft family recorded in a Lightning checkpoint (its target rebuilt from hparams)."""
    checkpoint = torch.load(checkpoint_path, map_location="cpu", weights_only=False)
    class_path = checkpoint.get("draft_class")
    if not class_path:
        raise ValueError(
            f"{checkpoint_path} has no 'draft_class'; it was not written by a lightning-drafts DraftModule"
        )
    module_name, _, class_name = class_path.rpartition(".")
    draft_class = getattr(importlib.import_module(module_name), class_name)
    # Training-layout options say nothing about the weights, and loading runs on one process: drop them.
    overrides = {"shard_target": False, "activation_checkpointing": False}
    if target is not None:
        overrides["target"] = target
    return draft_class.load_from_checkpoint(checkpoint_path, map_location="cpu", **overrides)


def export_checkpoint(
    checkpoint_path: str | Path, output_dir: str | Path, target: str | None = None, layout: str | None = None
) -> Path:
    """Load ``checkpoint_path``, write its serving layout to ``output_dir`` and validate what was written
    (a defect raises ``ValueError`` naming the field). ``layout`` chooses among a family's layouts
    (DSpark: ``specforge`` / ``nemo``); None takes the family's default."""
    from lightning_drafts.evaluate import validate_export

    module = load_draft_checkpoint(checkpoint_path, target=target)
    if layout is None:
        path = module.export(Path(output_dir))
    elif "layout" in inspect.signature(module.export).parameters:
        path = module.export(Path(output_dir), layout=layout)
    else:
        raise ValueError(f"layout {layout!r} was given, but {type(module).__name__} exports one layout only")
    # What serving reads is checked against the target it will serve with, for every family.
    validate_export(path, target=module.target)
    return path
