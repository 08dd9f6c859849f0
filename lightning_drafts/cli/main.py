"""The ``lightning-drafts`` command: dispatch to a subcommand, importing only what it needs (so that
``--help`` answers at once: torch and Lightning load only when a subcommand runs)."""

from __future__ import annotations

import argparse
import atexit
import importlib
import sys
from typing import Any

from lightning_drafts.cli.console_notices import leave_out_dependency_notices
from lightning_drafts.cli.process_group import end_process_group
from lightning_drafts.cli.user_errors import DEBUG_ENV, DEBUG_FLAG, debug_requested, report_user_errors

SUBCOMMANDS = {
    "fit": "train a draft from a YAML config (LightningCLI; `fit --help` lists every option)",
    "validate": "validation metrics of a config's model, e.g. of a checkpoint (--ckpt_path)",
    "capture": "run a fit config's frozen target once over its data and store its draft's features",
    "export": "write a trained checkpoint in the layout vLLM / SGLang load, validated against its target",
    "evaluate": "serve an export with real greedy speculative decoding: served vs training acceptance",
    "regenerate": "rewrite a config's answers with its own target (train on what the target writes)",
    "plot": "draw a run's loss, val/accept_len and acceptance-by-position curves into PNG files",
    "convert-gguf": "write a GGUF target as the Hugging Face folder vLLM / SGLang load",
    "plan": "estimate a config's peak memory per rank, tokens and model FLOPs per step (nothing loaded)",
}
# The subcommands with an argparse parser (fit / validate are LightningCLI's): module, its main.
ARGPARSE_COMMANDS = {
    "capture": ("lightning_drafts.cli.capture", "capture_main"),
    "export": ("lightning_drafts.cli.export", "export_main"),
    "evaluate": ("lightning_drafts.cli.evaluate", "evaluate_main"),
    "regenerate": ("lightning_drafts.cli.regenerate", "regenerate_main"),
    "plot": ("lightning_drafts.cli.plot", "plot_main"),
    "convert-gguf": ("lightning_drafts.cli.convert_gguf", "convert_gguf_main"),
    "plan": ("lightning_drafts.cli.plan", "plan_main"),
}
USAGE = (
    "usage: lightning-drafts {"
    + ",".join(SUBCOMMANDS)
    + "} ...\n\n"
    + "\n".join(f"  {name:12}{text}" for name, text in SUBCOMMANDS.items())
    + f"\n\nA mistake in an option, a config or a data file prints one message; {DEBUG_FLAG} (or {DEBUG_ENV}=1) "
    "shows its traceback."
)


def main(args: list[str] | None = None) -> None:
    """Entry point of ``lightning-drafts`` and ``python -m lightning_drafts``."""
    debug, given = debug_requested(sys.argv[1:] if args is None else args)
    if args is None:
        # LightningCLI reads the command line itself (fit / validate), which must not hold --debug.
        sys.argv[1:] = given
    command = given[0] if given else None
    if command in (None, "-h", "--help"):
        print(USAGE)
        return
    if command not in SUBCOMMANDS:
        raise SystemExit(f"lightning-drafts: unknown subcommand {command!r}\n\n{USAGE}")
    leave_out_dependency_notices()
    report_user_errors(command, lambda: _dispatch(command, given[1:], None if args is None else given), debug)


def _dispatch(command: str, rest: list[str], cli_args: list[str] | None) -> None:
    if command in ARGPARSE_COMMANDS:
        module, entry = ARGPARSE_COMMANDS[command]
        getattr(importlib.import_module(module), entry)(rest)
    else:
        # At exit, not after the fit: a script may fit again in the same process group.
        atexit.unregister(end_process_group)  # once, however many fits a process runs
        atexit.register(end_process_group)
        run_cli(cli_args)


def run_cli(args: list[str] | None = None) -> Any:
    """``fit`` / ``validate`` through LightningCLI (see :func:`lightning_drafts.cli.fit.run_cli`)."""
    from lightning_drafts.cli.fit import run_cli as fit

    return fit(args)


def argparse_parser(command: str) -> argparse.ArgumentParser:
    """The parser of an argparse subcommand (the docs' reference and command checks read it)."""
    if command not in ARGPARSE_COMMANDS:
        raise ValueError(f"{command!r} has no argparse parser; those that do: {sorted(ARGPARSE_COMMANDS)}")
    return importlib.import_module(ARGPARSE_COMMANDS[command][0]).build_parser()
