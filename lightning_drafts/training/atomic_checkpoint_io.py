"""Checkpoints written whole or not at all, on the run's own filesystem.

Lightning's ``TorchCheckpointIO`` stages a local checkpoint in the system temp directory and then moves it
under its final name; across filesystems the move is a copy, so a disk that fills up during the copy
leaves a truncated ``best.ckpt`` / ``last.ckpt`` where the good one was. Here the checkpoint is written
to a temporary file beside the final one (same directory, same filesystem), flushed to disk, and only then
renamed over it (``os.replace``, atomic on POSIX and Windows): a failed save leaves the previous
checkpoint as it was and no partial file under the final name. A full disk is said in one line
(:class:`~lightning_drafts.core.disk_full.DiskFull`), not as ``torch.save``'s "unexpected pos" error.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import IO, Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.types import _PATH

from lightning_drafts.core.disk_full import DiskFull, is_disk_full


class AtomicCheckpointIO(TorchCheckpointIO):
    """:class:`TorchCheckpointIO` whose local saves go through a temporary file in the target directory
    and ``os.replace``; a remote path (``s3://...``) is left to Lightning's own save."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None
    ) -> None:
        if "://" in str(path) and not str(path).startswith("file://"):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        if storage_options is not None:
            raise TypeError(f"storage_options = {storage_options!r}: a local checkpoint save takes none")
        final = Path(str(path).removeprefix("file://"))
        final.parent.mkdir(parents=True, exist_ok=True)
        descriptor, staged = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".partial", dir=final.parent)
        try:
            with os.fdopen(descriptor, "wb") as handle:
                self.write(checkpoint, handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(staged, final)
        except BaseException as error:
            Path(staged).unlink(missing_ok=True)
            if not is_disk_full(error):
                raise
            kept = f"the previous {final.name} is kept" if final.exists() else f"no {final.name} was written"
            raise DiskFull(
                f"no space left on the disk of {final}: {shutil.disk_usage(final.parent).free:,} bytes free there "
                f"({kept}); free space there, or write the run to another disk (trainer.logger.init_args.save_dir)"
            ) from error

    def write(self, checkpoint: dict[str, Any], handle: IO[bytes]) -> None:
        """Serialise ``checkpoint`` into the open staging file."""
        torch.save(checkpoint, handle)
