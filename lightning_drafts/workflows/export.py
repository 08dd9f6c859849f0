"""Export a trained draft checkpoint in the layout its serving engine loads, and validate an export."""

from __future__ import annotations

import importlib
from pathlib import Path

import torch
import yaml

from lightning_drafts.core.output_lock import exclusive_output
from lightning_drafts.registry import REGISTRY
from lightning_drafts.serving.export_files import ExportSummary, check_destination, staged_export
from lightning_drafts.serving.model_card import TrainingFacts, write_card
from lightning_drafts.training.checkpoint_integrity import check_digests
from lightning_drafts.training.module import DraftModule
from lightning_drafts.training.target import FrozenTarget
from lightning_drafts.workflows.checkpoint_hyperparameters import naming_checkpoint


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
    check_digests(checkpoint, where=str(checkpoint_path))
    class_path = checkpoint.get("draft_class")
    if not class_path:
        raise ValueError(
            f"{checkpoint_path} has no 'draft_class'; it was not written by a lightning-drafts DraftModule"
        )
    # A registered class answers to where it was defined in earlier releases too; another DraftModule
    # (a family not in the registry) is imported from where the checkpoint says.
    draft_class = REGISTRY.module_class(class_path)
    if draft_class is None:
        module_name, _, class_name = class_path.rpartition(".")
        draft_class = getattr(importlib.import_module(module_name), class_name)
    # Training-layout options say nothing about the weights, and loading runs on one process: drop them.
    overrides = {"shard_target": False, "activation_checkpointing": False}
    if target is not None:
        overrides["target"] = target
    with naming_checkpoint(checkpoint_path):
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
            training = training_facts(checkpoint_path)
            export_module(
                module, staging, layout=layout, training=training, served_from=Path(output_dir).resolve()
            )
            family.validate(staging, module.target)
    return Path(output_dir)


def export_module(
    module: DraftModule,
    output_dir: str | Path,
    layout: str | None = None,
    training: TrainingFacts | None = None,
    served_from: str | Path | None = None,
) -> Path:
    """Write ``module``'s serving layout (``module.export``; :func:`export_checkpoint` validates it) and
    its model card (``README.md``: ``training`` says how it was trained, ``served_from`` where the export
    will be served from, default ``output_dir``), refusing a layout its family does not have. The module
    writes the serving files only: the card's serving commands come from its family's record."""
    family = REGISTRY.for_module(module)
    if layout is not None and layout not in family.layouts:
        offered = (
            f"writes the layouts {list(family.layouts)}" if family.layouts else "exports one layout only"
        )
        raise ValueError(f"layout {layout!r} was given, but {type(module).__name__} {offered}")
    if family.layouts:
        path = module.export(Path(output_dir), layout=layout)
    else:
        path = module.export(Path(output_dir))
    write_card(module, family, path, export_dir=served_from, training=training)
    return path


def training_facts(checkpoint_path: str | Path) -> TrainingFacts:
    """What a ``fit`` checkpoint records of its training, for the model card: steps, epochs, the loader's
    documents and tokens, the ``val/accept_len`` its ``ModelCheckpoint`` saved it at, and the data files of
    the ``config.yaml`` LightningCLI writes beside its ``checkpoints/`` directory (when present)."""
    # Memory-mapped: the draft's tensors were loaded once already and are not read here.
    checkpoint = torch.load(checkpoint_path, map_location="cpu", weights_only=False, mmap=True)
    score = None
    for state in (checkpoint.get("callbacks") or {}).values():
        if (
            isinstance(state, dict)
            and state.get("monitor") == "val/accept_len"
            and state.get("current_score") is not None
        ):
            score = float(state["current_score"])
    identity = next(
        (
            v["identity"]
            for v in checkpoint.values()
            if isinstance(v, dict) and isinstance(v.get("identity"), dict)
        ),
        {},
    )
    return TrainingFacts(
        checkpoint=Path(checkpoint_path).name,
        steps=checkpoint.get("global_step"),
        epochs=checkpoint.get("epoch"),
        data_files=_config_data_files(Path(checkpoint_path).resolve().parent.parent / "config.yaml"),
        documents=identity.get("documents"),
        tokens=identity.get("tokens"),
        val_accept_len=score,
    )


def _config_data_files(config_path: Path) -> list[str] | None:
    """The fit config's ``data_files`` (``[]``: the embedded corpus), or ``None`` without a config."""
    if not config_path.is_file():
        return None
    data = (yaml.safe_load(config_path.read_text()) or {}).get("data") or {}
    files = (data.get("init_args") or {}).get("data_files")
    return [] if files is None else [files] if isinstance(files, str) else [str(f) for f in files]


def validate_export(directory: str | Path, target: FrozenTarget | None = None) -> ExportSummary:
    """Run the family validator of the export in ``directory`` (``ValueError`` on any defect)."""
    return REGISTRY.for_export(directory).validate(Path(directory), target)
