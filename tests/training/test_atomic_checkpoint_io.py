"""A checkpoint save that fails midway (a full disk) leaves the previous checkpoint as it was and no partial
file under the final name or beside it."""

from __future__ import annotations

import errno
from typing import IO, Any

import pytest
import torch

from lightning_drafts.core.disk_full import DiskFull
from lightning_drafts.training.atomic_checkpoint_io import AtomicCheckpointIO


class DiskFullAfter(AtomicCheckpointIO):
    """Writes the first ``limit`` bytes of the checkpoint, then fails as a full disk does."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def write(self, checkpoint: dict[str, Any], handle: IO[bytes]) -> None:
        handle.write(b"\0" * self.limit)
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError:
            # What torch.save raises when its zip writer meets the full disk.
            message = "[enforce fail at inline_container.cc:858] . unexpected pos 1603392 vs 1603280"
            raise RuntimeError(message)  # noqa: B904


def test_a_save_that_fails_midway_leaves_the_previous_checkpoint_intact(tmp_path):
    path = tmp_path / "checkpoints" / "best.ckpt"
    previous = {"state_dict": {"w": torch.arange(1000.0)}, "global_step": 4}
    AtomicCheckpointIO().save_checkpoint(previous, path)
    before = path.read_bytes()

    with pytest.raises(DiskFull) as refused:
        DiskFullAfter(limit=100).save_checkpoint({"state_dict": {"w": torch.zeros(1000)}}, path)
    # One line naming the checkpoint and what became of the previous one.
    assert str(refused.value).startswith(f"no space left on the disk of {path}: "), refused.value
    assert "(the previous best.ckpt is kept)" in str(refused.value) and "\n" not in str(refused.value)

    assert path.read_bytes() == before
    assert [p.name for p in path.parent.iterdir()] == ["best.ckpt"]
    loaded = torch.load(path, weights_only=True)
    assert loaded["global_step"] == 4 and torch.equal(loaded["state_dict"]["w"], torch.arange(1000.0))


def test_a_successful_save_replaces_the_checkpoint_whole(tmp_path):
    path = tmp_path / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"global_step": 1, "w": torch.ones(3)}, path)
    io.save_checkpoint({"global_step": 2, "w": torch.full((3,), 2.0)}, path)
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]
    loaded = io.load_checkpoint(path)
    assert loaded["global_step"] == 2 and torch.equal(loaded["w"], torch.full((3,), 2.0))
