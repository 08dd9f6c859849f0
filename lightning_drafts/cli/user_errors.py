"""A user's mistake (a bad option, value, path or file) printed as one short message, not a traceback.

Every subcommand runs through :func:`report_user_errors`. Our errors already say what was wrong, with the
value and what to write; they used to arrive under a long traceback, and those raised while jsonargparse
builds a class under its own dump of the union of candidate classes (74 lines for a batch size of 0).
Here the message of the error that explains the mistake is printed alone: jsonargparse's wrappers are
unwrapped down to the error raised by the code that judged the value, and the option it names is put
in front. ``--debug`` (anywhere on the command line) or ``LIGHTNING_DRAFTS_DEBUG=1`` lets the error
propagate with its traceback; an error that is not a user's mistake (a bug) always does.
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from lightning_drafts.cli.arguments import UsageError
from lightning_drafts.core.error_chain import error_chain

DEBUG_FLAG = "--debug"
DEBUG_ENV = "LIGHTNING_DRAFTS_DEBUG"
# What a mistake in the command line, a config, a path or a data file raises (OSError: a missing,
# unreadable or existing file; a full disk).
USER_ERRORS = (ValueError, OSError, argparse.ArgumentError)
# Errors raised inside these packages wrap the one that explains the mistake.
_WRAPPING_PACKAGES = ("jsonargparse", "argparse.py")
_PARSER_KEY = re.compile(r'Parser key "([^"]+)"')
_CLASS_PATH = re.compile(r"Problem with given class_path '([^']+)'")
_GIVEN = re.compile(r"Given value: (.*)")
_GOT = re.compile(r"Got value: (.*)$")
_REQUIRED = re.compile(r"^the following arguments are required: ([\w., ]+)$")
_TYPE = re.compile(r"<class '(?:[\w.]+\.)?(\w+)'>")

Result = TypeVar("Result")


def debug_requested(args: list[str]) -> tuple[bool, list[str]]:
    """Whether the traceback is asked for, and ``args`` without :data:`DEBUG_FLAG`."""
    rest = [arg for arg in args if arg != DEBUG_FLAG]
    return len(rest) < len(args) or os.environ.get(DEBUG_ENV, "") not in ("", "0"), rest


def report_user_errors(command: str, run: Callable[[], Result], debug: bool) -> Result:
    """``run()``; a user error it raises is printed as ``lightning-drafts COMMAND: error: MESSAGE`` and
    exits with status 2 (unless ``debug``)."""
    try:
        return run()
    except USER_ERRORS as error:
        if debug:
            raise
        print(f"lightning-drafts {command}: error: {describe(error)}", file=sys.stderr)
        if not isinstance(error, (argparse.ArgumentError, UsageError)):  # a usage error has no trace to see
            print(f"(add {DEBUG_FLAG}, or set {DEBUG_ENV}=1, to see the traceback)", file=sys.stderr)
        raise SystemExit(2) from None


def describe(error: BaseException) -> str:
    """The message that explains ``error``: the first error of its chain not raised by a parser wrapping
    another, prefixed by the option the wrappers name (``model.init_args.mask_token_id``, with the class
    it belongs to) and followed by the value they name when the message does not."""
    chain = list(error_chain(error))
    explaining = next((e for e in chain if not _raised_by_wrapper(e)), chain[-1])
    unwritable = _unwritable(explaining)
    if unwritable:
        return unwritable
    wrappers = " ".join(str(e) for e in chain[: chain.index(explaining)])
    message = re.sub(r"^Expected an? ", "expected ", _TYPE.sub(r"\1", str(explaining).strip()))
    keys = list(dict.fromkeys(_PARSER_KEY.findall(wrappers)))
    class_path = _CLASS_PATH.search(wrappers)
    where = ".init_args.".join([keys[0], ".".join(keys[1:])] if len(keys) > 1 and class_path else keys[:1])
    if class_path:
        where += f" ({class_path.group(1)})"
    given = [
        value for value in _GIVEN.findall(wrappers) if not value.startswith(("Namespace(", "NestedArg("))
    ]
    got = _GOT.search(message)
    value = got.group(1).strip() if got else given[0] if given else ""
    if message.startswith("expected float") and _not_finite(value):
        # YAML reads nan and inf as text, so jsonargparse's "expected float" names a float Python reads.
        message = f"{value} is not a finite number (YAML reads nan and inf as text, not floats); give a finite number"
    elif given and "value" not in message.lower():
        message += f"; given: {given[0]}"
    missing = _REQUIRED.match(message)
    if missing and {name.rpartition(".")[2] for name in missing.group(1).split(", ")} <= {"model", "data"}:
        # `fit` / `validate` without a config: the model and data a config names are what is missing.
        message = (
            "no config: pass --config FILE, a fit config naming the model and the data (configs/quickstart/"
            f"eagle3.yaml is one), or both --model and --data (missing: {missing.group(1)})"
        )
    return f"{where}: {message}" if where else message


def _unwritable(error: BaseException) -> str | None:
    """A bare OS error on a path that cannot be written (``[Errno 30] Read-only file system: 'runs'``, raised
    by a library creating a run's directories) said with what to do; our own messages are left as they are."""
    if not isinstance(error, OSError) or error.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
        return None
    if error.filename is None or not str(error).startswith("[Errno"):
        return None
    return (
        f"{error.filename} cannot be written: {error.strerror}; write to a path in a directory you can write "
        "(a fit writes its run under trainer.logger.init_args.save_dir, or trainer.default_root_dir without "
        "a logger)"
    )


def _not_finite(text: str) -> bool:
    try:
        return not math.isfinite(float(text))
    except ValueError:
        return False


def _raised_by_wrapper(error: BaseException) -> bool:
    if error.__cause__ is None and error.__context__ is None:
        return False  # nothing inside: it is the explanation itself
    trace = error.__traceback__
    while trace is not None and trace.tb_next is not None:
        trace = trace.tb_next
    if trace is None:
        return False
    parts = Path(trace.tb_frame.f_code.co_filename).parts
    return any(package in parts for package in _WRAPPING_PACKAGES)
