"""The argument parser of the argparse subcommands (capture, export, evaluate, regenerate, plot).

argparse answers a bad option with the whole usage (twenty lines for ``evaluate``) and exits; this one
raises :class:`UsageError` instead, which the command prints as its one message
(:mod:`lightning_drafts.cli.user_errors`) with where to find the options."""

from __future__ import annotations

import argparse
from typing import NoReturn


class UsageError(ValueError):
    """A bad option or value on a subcommand's command line."""


class CommandParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (`{self.prog} --help` lists the options)")
