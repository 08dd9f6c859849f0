"""The ``lightning-drafts`` command: dispatch to a subcommand, importing only what it needs (so that
``--help`` answers at once: torch and Lightning load only when a subcommand runs)."""

from __future__ import annotations

import sys
from typing import Any

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
)


def main(args: list[str] | None = None) -> None:
    """Entry point of ``lightning-drafts`` and ``python -m lightning_drafts``."""
    given = sys.argv[1:] if args is None else args
    command = given[0] if given else None
    if command in (None, "-h", "--help"):
        print(USAGE)
        return
    if command == "capture":
        from lightning_drafts.cli.capture import capture_main

        capture_main(given[1:])
    elif command == "export":
        from lightning_drafts.cli.export import export_main

        export_main(given[1:])
    elif command == "evaluate":
        from lightning_drafts.cli.evaluate import evaluate_main

        evaluate_main(given[1:])
    elif command == "regenerate":
        from lightning_drafts.cli.regenerate import regenerate_main

        regenerate_main(given[1:])
    elif command in SUBCOMMANDS:
        run_cli(args)
    else:
        raise SystemExit(f"lightning-drafts: unknown subcommand {command!r}\n\n{USAGE}")


def run_cli(args: list[str] | None = None) -> Any:
    """``fit`` / ``validate`` through LightningCLI (see :func:`lightning_drafts.cli.fit.run_cli`)."""
    from lightning_drafts.cli.fit import run_cli as fit

    return fit(args)
