"""Writing an export: a disk that fills on the way is named in one line with the bytes free there, and
nothing of the export is left behind."""

from __future__ import annotations

import errno
import os
import re

import pytest
from safetensors import SafetensorError

from lightning_drafts.serving.export_files import DiskFull, staged_export

# What the OS raises for a write to a full disk, and what safetensors raises for its own writes then.
FULL = [
    OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)),
    SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),
]


@pytest.mark.parametrize("full", FULL, ids=["os", "safetensors"])
def test_a_disk_that_fills_during_an_export_is_named_with_the_bytes_free(full, tmp_path):
    output = tmp_path / "export"
    with pytest.raises(DiskFull) as refused:
        # Nested as `export` writes: the export's staging, and the files' own staging inside it.
        with staged_export(output) as outer, staged_export(outer) as staging:
            (staging / "model.safetensors").write_bytes(bytes(4096))
            raise full
    named = re.fullmatch(
        rf"no space left on the disk of {re.escape(str(output))}: ([\d,]+) bytes free there \(nothing of the "
        r"export was kept\); free space there or export to another disk",
        str(refused.value),
    )
    assert named and int(named.group(1).replace(",", "")) > 0, str(refused.value)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def test_another_write_error_passes_unchanged(tmp_path):
    denied = PermissionError(errno.EACCES, os.strerror(errno.EACCES))
    with pytest.raises(PermissionError) as raised, staged_export(tmp_path / "export"):
        raise denied
    assert raised.value is denied
