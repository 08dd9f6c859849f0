"""The ``lightning-drafts`` command: dispatch to a subcommand, importing only what it needs (so that
``--help`` answers at once: torch and Lightning load only when a subcommand runs)."""

from __future__ import annotations

import sys
from typing import Any

from lightning_drafts.cli.user_errors import DEBUG_ENV, DEBUG_FLAG, debug_requested, report_user_errors

SUBCOMMANDS = {
    "fit": "train a draft from a YAML config (LightningCLI; `fit --help` lists every option)",
    "validate": "validation metrics of a config's model, e.g. of a checkpoint (--ckpt_path)",
    "capture": "run a fit config's frozen target once over its data and store its draft's features",
    "export": "write a trained checkpoint in the layout vLLM / SGLang load, validated against its target",
    "evaluate": "serve an export with real greedy speculative decoding: served vs training acceptance",
    "regenerate": "rewrite a config's answers with its own target (train on what the target writes)",
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
    report_user_errors(command, lambda: _dispatch(command, given[1:], None if args is None else given), debug)


def _dispatch(command: str, rest: list[str], cli_args: list[str] | None) -> None:
    if command == "capture":
        from lightning_drafts.cli.capture import capture_main

        capture_main(rest)
    elif command == "export":
        from lightning_drafts.cli.export import export_main

        export_main(rest)
    elif command == "evaluate":
        from lightning_drafts.cli.evaluate import evaluate_main

        evaluate_main(rest)
    elif command == "regenerate":
        from lightning_drafts.cli.regenerate import regenerate_main

        regenerate_main(rest)
    else:
        run_cli(cli_args)


def run_cli(args: list[str] | None = None) -> Any:
    """``fit`` / ``validate`` through LightningCLI (see :func:`lightning_drafts.cli.fit.run_cli`)."""
    from lightning_drafts.cli.fit import run_cli as fit

    return fit(args)
