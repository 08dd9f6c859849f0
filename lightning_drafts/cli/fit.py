"""``lightning-drafts fit`` / ``validate``: LightningCLI in subclass mode over :class:`DraftModule` and
:class:`PackedChatDataModule`, so a config names the draft family and the data module by ``class_path``."""

from __future__ import annotations

import importlib
import sys
import warnings
from pathlib import Path
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.plugins.io import CheckpointIO

from lightning_drafts.callbacks.data_match import DataMatchCallback
from lightning_drafts.callbacks.preemption import PreemptionCheckpoint
from lightning_drafts.callbacks.progress import console_progress_bar
from lightning_drafts.cli.console_notices import leave_out_own_run_notice
from lightning_drafts.cli.moved_names import refuse_moved_names
from lightning_drafts.cli.resume import resume_into_same_run, resumed_checkpoint
from lightning_drafts.cli.resumed_hyperparameters import refuse_changed_run
from lightning_drafts.cli.run_claim import claim_run_directory
from lightning_drafts.datamodules import PackedChatDataModule
from lightning_drafts.training.atomic_checkpoint_io import AtomicCheckpointIO
from lightning_drafts.training.checkpoint_integrity import check_digests, check_family
from lightning_drafts.training.final_checkpoint import FinalCheckpoint
from lightning_drafts.training.module import DraftModule
from lightning_drafts.workflows.checkpoint_hyperparameters import naming_checkpoint

# A bad option raises (an ArgumentError naming the option) instead of printing the whole usage and
# exiting: the command reports it in one message (cli.user_errors), a notebook gets an exception.
RAISE_PARSE_ERRORS = {
    "exit_on_error": False,
    **{name: {"exit_on_error": False} for name in ("fit", "validate")},
}


class DraftCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # The tokenizer decides the vocabulary a random quickstart target gets and what a real one must cover.
        parser.link_arguments(
            "data.vocab_size", "model.init_args.tokenizer_vocab_size", apply_on="instantiate"
        )
        parser.link_arguments("data.pad_token_id", "model.init_args.pad_token_id", apply_on="instantiate")

    def _parse_ckpt_path(self) -> None:
        # LightningCLI builds the model from the checkpoint's hyperparameters, its class included: refuse a
        # damaged checkpoint before reading them, and one of another family than the config names.
        subcommand = self.config.get("subcommand") or ""
        section = self.config.get(subcommand, None) or {}
        checkpoint_file = resumed_checkpoint(section)
        applied: dict[str, Any] = {}
        if checkpoint_file is not None:
            checkpoint = _load(checkpoint_file)
            check_digests(checkpoint, where=str(checkpoint_file))
            model = section.get("model")
            class_path = getattr(model, "class_path", None)
            if class_path:
                draft_class = _class_of(class_path)
                check_family(
                    checkpoint,
                    f"{draft_class.__module__}.{draft_class.__qualname__}",
                    where=str(checkpoint_file),
                    former=getattr(draft_class, "former_class_paths", ()),
                )
            if subcommand == "fit" and model is not None and getattr(model, "init_args", None) is not None:
                given = model.init_args.as_dict()
                saved = checkpoint.get("hyper_parameters") or {}
                applied = refuse_changed_run(given, saved, str(checkpoint_file))
        super()._parse_ckpt_path()
        for name, value in applied.items():
            self.config[subcommand]["model"]["init_args"][name] = value

    def instantiate_classes(self) -> None:
        section = (self.config[self.subcommand] if self.subcommand else self.config) or {}
        with naming_checkpoint(section.get("ckpt_path")):
            super().instantiate_classes()

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        if self.subcommand == "validate":
            # Validation trains nothing, so it writes nothing either (LightningCLI would save config.yaml
            # into the log directory, which is the current directory when the logger is off).
            self.save_config_callback = None
        if "callbacks" in kwargs:
            return super().instantiate_trainer(**kwargs)
        section = self.config_init[self.subcommand] if self.subcommand else self.config_init
        trainer = section.get("trainer") or {}
        callbacks = trainer.get("callbacks") or []
        callbacks = list(callbacks) if isinstance(callbacks, list) else [callbacks]
        if self.subcommand == "validate" and section.get("ckpt_path"):
            _point_checkpoint_callbacks_at(section["ckpt_path"], callbacks)
        # Lightning's default bar shows the run's version as a metric and "Epoch 0/-2" for a run bounded
        # by max_steps; ours does neither. A bar the config names, or enable_progress_bar: false, wins.
        if trainer.get("enable_progress_bar") is not False and not any(
            isinstance(callback, ProgressBar) for callback in callbacks
        ):
            callbacks.append(console_progress_bar())
        # Every fit says how far its answers are from the target's own (a config's own
        # DataMatchCallback, e.g. with num_documents: 0, wins).
        if self.subcommand == "fit" and not any(isinstance(c, DataMatchCallback) for c in callbacks):
            callbacks.append(DataMatchCallback())
        # SIGTERM / Ctrl-C save a resumable last.ckpt and exit non-zero (a config's own instance wins).
        if self.subcommand == "fit" and not any(isinstance(c, PreemptionCheckpoint) for c in callbacks):
            callbacks.append(PreemptionCheckpoint())
        # A finished fit leaves last.ckpt even without validation (a config's own instance wins).
        if self.subcommand == "fit" and not any(isinstance(c, FinalCheckpoint) for c in callbacks):
            callbacks.append(FinalCheckpoint())
        plugins = trainer.get("plugins") or []
        plugins = list(plugins) if isinstance(plugins, list) else [plugins]
        # Checkpoints are written whole or not at all, beside their final name (a CheckpointIO of the
        # config's own, as a plugin or on its strategy, wins).
        own = getattr(trainer.get("strategy"), "_checkpoint_io", None)
        if own is None and not any(isinstance(plugin, CheckpointIO) for plugin in plugins):
            plugins.append(AtomicCheckpointIO())
        return super().instantiate_trainer(callbacks=callbacks, plugins=plugins, **kwargs)

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        if self.subcommand == "fit":
            refuse_idle_trainer(config.get("trainer") or {})
            if resume_into_same_run(config) is None:
                claim_run_directory(config)
            else:
                leave_out_own_run_notice()
        # LightningCLI applies a YAML scheduler only together with a YAML optimizer; alone it would be
        # dropped without a word and the module's own AdamW + warmup-cosine would run.
        if config.get("lr_scheduler") and not config.get("optimizer"):
            raise ValueError(
                f"lr_scheduler {config['lr_scheduler'].get('class_path')!r} is set without an optimizer, so it "
                "would be ignored; set `optimizer:` too (the model's learning_rate, betas, weight_decay, "
                "warmup_ratio and min_lr_ratio then no longer apply) or drop lr_scheduler"
            )


def run_cli(args: list[str] | None = None) -> DraftCLI:
    """LightningCLI for ``fit`` / ``validate`` (returned so notebooks and tests can read the trainer).

    ``args=None`` lets LightningCLI read the command line itself (as a console entry point should)."""
    refuse_moved_names(sys.argv[1:] if args is None else args)
    return DraftCLI(
        DraftModule,
        PackedChatDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=args,
        save_config_kwargs={"overwrite": True},
        parser_kwargs=RAISE_PARSE_ERRORS,
    )


def refuse_idle_trainer(trainer: Any) -> None:
    """Refuse trainer settings under which a fit would do nothing (``max_steps: 0``: exit 0, nothing trained)
    or fail late (``accumulate_grad_batches: 0``: Lightning's ZeroDivisionError after the data set-up)."""
    if trainer.get("max_steps") == 0:
        raise ValueError(
            "trainer.max_steps = 0 trains nothing; set a positive number of steps (or -1 to train for "
            "trainer.max_epochs)"
        )
    accumulate = trainer.get("accumulate_grad_batches")
    if accumulate is not None and (not isinstance(accumulate, int) or accumulate < 1):
        raise ValueError(
            f"trainer.accumulate_grad_batches = {accumulate!r}; it must be a positive integer (1 steps the "
            "optimiser after every batch)"
        )


def _point_checkpoint_callbacks_at(ckpt_path: str, callbacks: list[Any]) -> None:
    """Give a fit config's ``ModelCheckpoint`` callbacks the directory they saved ``ckpt_path``'s state from.

    ``validate`` restores them from the checkpoint it validates (Lightning warns if they are missing), and
    each then warns that the new run's directory differs from the one in its state. Validation writes no
    checkpoint, so the saved directory is the honest one; a callback given its own ``dirpath`` keeps it.
    """
    path = Path(ckpt_path)
    if not path.is_file():
        return  # Lightning names a missing or misspelled checkpoint itself
    saved = _load(path).get("callbacks") or {}
    for callback in callbacks:
        if isinstance(callback, ModelCheckpoint) and callback.dirpath is None:
            dirpath = (saved.get(callback.state_key) or {}).get("dirpath")
            if dirpath is not None:
                callback.dirpath = dirpath


def _load(path: str | Path) -> dict[str, Any]:
    import torch

    return torch.load(path, map_location="cpu", mmap=True, weights_only=False)


def _class_of(class_path: str) -> type:
    """The class a config's class_path names (it may name a re-export such as
    ``lightning_drafts.Eagle3Module``; checkpoints record where the class is defined)."""
    module_name, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module_name), name)


def build_from_config(args: list[str]) -> tuple[DraftModule, Any]:
    """The model and data module a ``fit`` config (plus overrides) names, built as ``fit`` builds them
    (the tokenizer's vocabulary and pad id linked into the model), without a trainer run."""
    refuse_moved_names(args)
    with warnings.catch_warnings():
        # The command line holds the calling subcommand's own options too; `args` is what the config reads.
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
        cli = DraftCLI(
            DraftModule,
            PackedChatDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            args=args,
            run=False,
            save_config_callback=None,
            parser_kwargs=RAISE_PARSE_ERRORS,
        )
    return cli.model, cli.datamodule
