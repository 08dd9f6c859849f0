"""A full disk, told apart from other write errors wherever a writer meets it.

The libraries that write for us report a full disk in their own ways: ``OSError`` with ``ENOSPC``,
safetensors' own error carrying the OS error's text, and ``torch.save`` a ``RuntimeError`` ("unexpected
pos ...") raised while the ``OSError`` is being handled. Writers turn any of them into :class:`DiskFull`,
one line naming the path and the bytes free, which the command line prints without a traceback.
"""

from __future__ import annotations

import errno


class DiskFull(OSError):
    """The disk filled while something was written (its message names the path and the bytes free)."""


def is_disk_full(error: BaseException) -> bool:
    """Whether ``error``, or an error it was raised from or while handling, is a full disk."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno == errno.ENOSPC:
            return True
        if f"os error {errno.ENOSPC})" in str(current):
            return True
        current = current.__cause__ or current.__context__
    return False
