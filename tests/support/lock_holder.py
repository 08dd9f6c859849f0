"""Another process writing an output: it holds the output's writer lock until the block ends."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

HOLD = """
import sys
from lightning_drafts.core.output_lock import exclusive_output
with exclusive_output(sys.argv[1]):
    print("held", flush=True)
    sys.stdin.readline()
"""


@contextmanager
def held_by_another_process(output: str | Path) -> Iterator[subprocess.Popen]:
    """A process holding ``output``'s lock (``exclusive_output``) for the block; it exits after."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(output), "--marker-of-the-holder"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        yield holder
    finally:
        holder.stdin.close()
        holder.wait(timeout=600)  # a hang guard only
