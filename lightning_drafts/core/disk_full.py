"""A full disk, told apart from other write errors wherever a writer meets it.

The libraries that write for us report a full disk in their own ways: ``OSError`` with ``ENOSPC``,
safetensors' own error carrying the OS error's text, and ``torch.save`` a ``RuntimeError`` ("unexpected
pos ...") raised while the ``OSError`` is being handled. Writers turn any of them into :class:`DiskFull`,
one line naming the path and the bytes free, which the command line prints without a traceback.
"""

from __future__ import annotations

import errno

from lightning_drafts.core.error_chain import error_chain


class DiskFull(OSError):
    """The disk filled while something was written (its message names the path and the bytes free)."""


def is_disk_full(error: BaseException) -> bool:
    """Whether ``error``, or an error it was raised from or while handling, is a full disk."""
    return any(
        (isinstance(link, OSError) and link.errno == errno.ENOSPC) or f"os error {errno.ENOSPC})" in str(link)
        for link in error_chain(error)
    )
