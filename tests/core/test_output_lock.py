"""One writer per output: a second writer is refused at once, naming the first; the lock goes with its
process however it ends; an export held by another process is left as it was."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from lightning_drafts.core.output_lock import OutputInUse, exclusive_output, lock_path
from lightning_drafts.serving.export_files import write_export
from tests.support.lock_holder import held_by_another_process


def test_a_second_writer_is_refused_naming_the_first(tmp_path):
    output = tmp_path / "export"
    with held_by_another_process(output) as holder:
        with pytest.raises(OutputInUse) as refused:
            with exclusive_output(output):
                pytest.fail("the lock was taken twice")
        message = str(refused.value)
        assert f"{output} is being written by another run (process {holder.pid} on " in message
        assert "--marker-of-the-holder" in message and str(lock_path(output)) in message
    with exclusive_output(output):  # free once the holder ended
        with exclusive_output(output):  # and a writer inside a writer of this process goes on
            pass


def test_a_killed_writer_leaves_no_lock_behind(tmp_path):
    output = tmp_path / "answers.jsonl"
    with held_by_another_process(output) as holder:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(timeout=600)
        with exclusive_output(output):
            pass


def test_an_export_into_a_directory_another_run_writes_is_refused_and_changes_nothing(tmp_path):
    output = tmp_path / "export"
    with held_by_another_process(output):
        with pytest.raises(OutputInUse, match="is being written by another run"):
            write_export(output, {"architectures": ["X"]}, {"w": torch.zeros(2)})
    assert not output.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".export.lock"]  # no staging left behind
    write_export(output, {"architectures": ["X"]}, {"w": torch.zeros(2)})
    assert sorted(p.name for p in output.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".export.lock", "export"]


def test_an_output_that_cannot_be_written_is_refused_naming_the_output_not_its_lock(tmp_path):
    # Opening the lock file fails as it does in a read-only directory (there with "Permission denied" or
    # "Read-only file system"); a directory in its place fails for any user, root included.
    output = tmp_path / "export"
    lock_path(output).mkdir()
    with pytest.raises(OSError) as refused:
        with exclusive_output(output):
            pytest.fail("the lock was taken")
    message = str(refused.value)
    assert message.startswith(f"{output} cannot be written: Is a directory in {tmp_path}; "), message
    assert ".lock" not in message
