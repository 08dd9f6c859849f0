"""``lightning-drafts export``: write a trained checkpoint in the layout serving engines load."""

from __future__ import annotations

import argparse

from lightning_drafts.cli.arguments import CommandParser


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
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
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the export files (config, weights, shards) of a non-empty output_dir; nothing else",
    )
    return parser


def export_main(args: list[str]) -> None:
    from lightning_drafts.workflows.export import export_checkpoint

    parsed = build_parser().parse_args(args)
    path = export_checkpoint(
        parsed.checkpoint,
        parsed.output_dir,
        target=parsed.target,
        layout=parsed.layout,
        overwrite=parsed.overwrite,
    )
    print(f"exported {parsed.checkpoint} -> {path}")
