"""The argparse type of the subcommands' count options (prompts, tokens, rows, shards): a positive int.

A count of 0 or less has no honest meaning there (``--num-prompts 0`` used to evaluate one prompt), so
argparse refuses it with its one-line ``error: argument --num-prompts: ...`` and the usage."""

from __future__ import annotations

import argparse


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
