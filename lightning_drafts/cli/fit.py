"""``lightning-drafts fit`` / ``validate``: LightningCLI in subclass mode over :class:`DraftModule` and
:class:`PackedChatDataModule`, so a config names the draft family and the data module by ``class_path``."""

from __future__ import annotations

import sys
import warnings
from typing import Any

from lightning.pytorch.cli import LightningArgumentParser, LightningCLI

from lightning_drafts.cli.moved_names import refuse_moved_class_paths
from lightning_drafts.datamodules import PackedChatDataModule
from lightning_drafts.training.module import DraftModule


class DraftCLI(LightningCLI):
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # The tokenizer decides the vocabulary a random quickstart target gets and what a real one must cover.
        parser.link_arguments(
            "data.vocab_size", "model.init_args.tokenizer_vocab_size", apply_on="instantiate"
        )
        parser.link_arguments("data.pad_token_id", "model.init_args.pad_token_id", apply_on="instantiate")

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
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
    refuse_moved_class_paths(sys.argv[1:] if args is None else args)
    return DraftCLI(
        DraftModule,
        PackedChatDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=args,
        save_config_kwargs={"overwrite": True},
    )


def build_from_config(args: list[str]) -> tuple[DraftModule, Any]:
    """The model and data module a ``fit`` config (plus overrides) names, built as ``fit`` builds them
    (the tokenizer's vocabulary and pad id linked into the model), without a trainer run."""
    refuse_moved_class_paths(args)
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
        )
    return cli.model, cli.datamodule
