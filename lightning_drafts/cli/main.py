"""The ``lightning-drafts`` command: dispatch to a subcommand, importing only what it needs (so that
``--help`` answers at once: torch and Lightning load only when a subcommand runs)."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

SUBCOMMANDS = {
    "fit": "train a draft from a YAML config (LightningCLI; `fit --help` lists every option)",
    "validate": "validation metrics of a config's model, e.g. of a checkpoint (--ckpt_path)",
    "capture": "run a fit config's frozen target once over its data and store its draft's features",
    "export": "write a trained checkpoint in the layout vLLM / SGLang load, validated against its target",
    "evaluate": "serve an export with real greedy speculative decoding: served vs training acceptance",
    "regenerate": "rewrite a config's answers with its own target (train on what the target writes)",
    "plot": "draw a run's loss, val/accept_len and acceptance-by-position curves into PNG files",
}
# The subcommands with an argparse parser (fit / validate are LightningCLI's): module, its main.
ARGPARSE_COMMANDS = {
    "capture": ("lightning_drafts.cli.capture", "capture_main"),
    "export": ("lightning_drafts.cli.export", "export_main"),
    "evaluate": ("lightning_drafts.cli.evaluate", "evaluate_main"),
    "regenerate": ("lightning_drafts.cli.regenerate", "regenerate_main"),
    "plot": ("lightning_drafts.cli.plot", "plot_main"),
}
USAGE = (
    "usage: lightning-drafts {"
    + ",".join(SUBCOMMANDS)
    + "} ...\n\n"
    + "\n".join(f"  {name:12}{text}" for name, text in SUBCOMMANDS.items())
)


def main(args: list[str] | None = None) -> None:
    """Entry point of ``lightning-drafts`` and ``python -m lightning_drafts``."""
    given = sys.argv[1:] if args is None else args
    command = given[0] if given else None
    if command in (None, "-h", "--help"):
        print(USAGE)
        return
    if command in ARGPARSE_COMMANDS:
        module, entry = ARGPARSE_COMMANDS[command]
        getattr(importlib.import_module(module), entry)(given[1:])
    elif command in SUBCOMMANDS:
        run_cli(args)
    else:
        raise SystemExit(f"lightning-drafts: unknown subcommand {command!r}\n\n{USAGE}")


def run_cli(args: list[str] | None = None) -> Any:
    """``fit`` / ``validate`` through LightningCLI (see :func:`lightning_drafts.cli.fit.run_cli`)."""
    from lightning_drafts.cli.fit import run_cli as fit

    return fit(args)


def argparse_parser(command: str) -> argparse.ArgumentParser:
    """The parser of an argparse subcommand (the docs' reference and command checks read it)."""
    if command not in ARGPARSE_COMMANDS:
        raise ValueError(f"{command!r} has no argparse parser; those that do: {sorted(ARGPARSE_COMMANDS)}")
    return importlib.import_module(ARGPARSE_COMMANDS[command][0]).build_parser()
