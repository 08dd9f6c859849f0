"""Export a trained draft checkpoint in the layout its serving engine loads, and validate an export."""

from __future__ import annotations

import importlib
from pathlib import Path

import torch

from lightning_drafts.core.output_lock import exclusive_output
from lightning_drafts.registry import REGISTRY
from lightning_drafts.serving.export_files import ExportSummary, check_destination, staged_export
from lightning_drafts.training.module import DraftModule
from lightning_drafts.training.target import FrozenTarget


def load_draft_checkpoint(checkpoint_path: str | Path, target: str | None = None) -> DraftModule:
    """Rebuild the draft family recorded in a Lightning checkpoint (its target rebuilt from hparams)."""
    try:
        checkpoint = torch.load(checkpoint_path, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise
    except Exception as error:  # torch.load raises many types for a file that is not a checkpoint
        raise ValueError(
            f"{checkpoint_path} is not a readable Lightning checkpoint ({type(error).__name__}: {error}); pass "
            "a .ckpt file written by `lightning-drafts fit`"
        ) from error
    if not isinstance(checkpoint, dict):
        raise ValueError(f"{checkpoint_path} holds a {type(checkpoint).__name__}, not a Lightning checkpoint")
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
    checkpoint_path: str | Path,
    output_dir: str | Path,
    target: str | None = None,
    layout: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Load ``checkpoint_path``, write its serving layout to ``output_dir`` and validate what was written
    (a defect raises ``ValueError`` naming the field). ``layout`` chooses among a family's layouts
    (DSpark: ``specforge`` / ``nemo``); None takes the family's default. A non-empty ``output_dir`` is
    refused unless ``overwrite`` (which replaces only export files there)."""
    # One writer for the whole run, from before the minutes a large target takes to load.
    with exclusive_output(output_dir):
        check_destination(output_dir, overwrite)
        module = load_draft_checkpoint(checkpoint_path, target=target)
        family = REGISTRY.for_module(module)
        # What serving reads is checked against the target it will serve with, for every family, before it
        # lands: a refused export leaves output_dir as it was.
        with staged_export(output_dir, overwrite=overwrite) as staging:
            family.export(module, staging, layout=layout)
            family.validate(staging, module.target)
    return Path(output_dir)


def validate_export(directory: str | Path, target: FrozenTarget | None = None) -> ExportSummary:
    """Run the family validator of the export in ``directory`` (``ValueError`` on any defect)."""
    return REGISTRY.for_export(directory).validate(Path(directory), target)
