"""The ``lightning-drafts`` command.

``fit`` / ``validate`` are LightningCLI (subclass mode over :class:`DraftModule` and
:class:`PackedChatDataModule`, so a config names the draft family by ``class_path``);
``export`` writes the serving layout of a trained checkpoint; ``evaluate`` serves an exported draft with
real greedy speculative decoding and reports its acceptance beside the training-time estimate.
"""

from __future__ import annotations

import argparse
import sys

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


def main(args: list[str] | None = None) -> None:
    """Entry point of ``lightning-drafts`` and ``python -m lightning_drafts``."""
    args = sys.argv[1:] if args is None else args
    if args[:1] == ["export"]:
        export_main(args[1:])
        return
    if args[:1] == ["evaluate"]:
        from lightning_drafts.cli.evaluate import evaluate_main

        evaluate_main(args[1:])
        return
    run_cli(args)


def run_cli(args: list[str]) -> DraftCLI:
    """LightningCLI for ``fit`` / ``validate`` (returned so notebooks and tests can read the trainer)."""
    refuse_moved_class_paths(args)
    return DraftCLI(
        DraftModule,
        PackedChatDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=args,
        save_config_kwargs={"overwrite": True},
    )


def export_main(args: list[str]) -> None:
    from lightning_drafts.workflows.export import export_checkpoint

    parser = argparse.ArgumentParser(
        prog="lightning-drafts export",
        description="Write a trained draft in the layout serving engines load.",
    )
    parser.add_argument("checkpoint", help="a Lightning checkpoint written by `lightning-drafts fit`")
    parser.add_argument("output_dir", help="the directory to write (config.json + model.safetensors)")
    parser.add_argument(
        "--target", default=None, help="override the target (hub id / local path) stored in the checkpoint"
    )
    parser.add_argument(
        "--layout", default=None, help="DSpark: specforge (SGLang) or nemo (default: specforge when it fits)"
    )
    parsed = parser.parse_args(args)
    path = export_checkpoint(parsed.checkpoint, parsed.output_dir, target=parsed.target, layout=parsed.layout)
    print(f"exported {parsed.checkpoint} -> {path}")
