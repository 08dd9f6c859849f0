"""One writer per output: ``export``, ``capture`` and ``regenerate`` hold a lock on what they write.

Two runs writing one export directory both reported success while one silently replaced the other; two
captures or regenerations into one output interleave their shards or rows. A writer takes an exclusive
``filelock`` lock on ``.<name>.lock`` beside its output for the whole run; a second writer is refused at
once, naming the first (process, host, start time, command), which the lock file records. The operating
system releases the lock when its process ends, however it ends, so a killed run never leaves its output
locked. The lock file stays (deleting it would let a third writer lock a new file while a second still
holds the old one).
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import filelock

# The outputs this process holds: a writer called inside another (export inside its checkpoint export)
# goes on under the lock already held, since a second lock of one file would refuse its own process.
_HELD: set[Path] = set()


class OutputInUse(OSError):
    """Another process is writing the same output."""


def lock_path(output: str | os.PathLike) -> Path:
    """The lock file of ``output``: ``.<name>.lock`` in the same directory."""
    output = Path(output).absolute()
    return output.with_name(f".{output.name}.lock")


@contextmanager
def exclusive_output(output: str | os.PathLike) -> Iterator[None]:
    """Hold the writer lock of ``output`` for the block; raise :class:`OutputInUse` naming the other
    writer when another process holds it."""
    key = Path(output).absolute()
    if key in _HELD:
        yield
        return
    path = lock_path(key)
    lock = filelock.FileLock(str(path), timeout=0)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock.acquire()
    except filelock.Timeout:
        raise OutputInUse(
            f"{output} is being written by another run ({_owner(path)}); wait for it to end, or write to "
            f"another path (its lock: {path})"
        ) from None
    except OSError as error:
        # The lock is the first file written beside the output: a read-only directory is refused here, and
        # the user knows the output path, not the lock file's.
        raise OSError(
            f"{output} cannot be written: {error.strerror or error} in {key.parent}; write to a path in a "
            "directory you can write"
        ) from error
    _HELD.add(key)
    try:
        path.write_text(
            f"process {os.getpid()} on {socket.gethostname()}, started "
            f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}: {' '.join(sys.argv) or sys.executable}\n"
        )
        yield
    finally:
        _HELD.discard(key)
        lock.release()


@contextmanager
def private_output(output: str | os.PathLike) -> Iterator[None]:
    """Treat ``output`` as held by this process for the block, without a lock file: a temporary directory
    no other process knows (an export's staging directory, which a family's writer writes as an output)."""
    key = Path(output).absolute()
    _HELD.add(key)
    try:
        yield
    finally:
        _HELD.discard(key)


def _owner(path: Path) -> str:
    try:
        return path.read_text().strip() or "a writer that has not recorded itself yet"
    except OSError:
        return "a writer whose lock file cannot be read"
