"""The command line of the argparse subcommands (capture, export, evaluate, regenerate, plot, convert-gguf).

argparse answers a bad option with the whole usage (twenty lines for ``evaluate``) and exits;
:class:`CommandParser` raises :class:`UsageError` instead, which the command prints as its one message
(:mod:`lightning_drafts.cli.user_errors`) with where to find the options. The count options (prompts,
tokens, rows, shards) take :func:`positive_int`: a count of 0 or less has no honest meaning there
(``--num-prompts 0`` used to evaluate one prompt)."""

from __future__ import annotations

import argparse
from typing import NoReturn


class UsageError(ValueError):
    """A bad option or value on a subcommand's command line."""


class CommandParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (`{self.prog} --help` lists the options)")


def positive_int(text: str) -> int:
    """``text`` as an int >= 1, else ``argparse.ArgumentTypeError`` naming the value and what to write."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a whole number; write a positive integer"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive count; write an integer >= 1")
    return value
