"""Nothing lost or silently wrong: a damaged checkpoint is refused wherever it is loaded, and an export
never lands over other files unless asked, and then replaces only export files."""

from __future__ import annotations

import shutil
import stat
import zipfile
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_drafts.cli.main import main
from lightning_drafts.serving.export_files import CONFIG_FILE, WEIGHTS_FILE
from lightning_drafts.workflows.export import export_checkpoint, load_draft_checkpoint
from tests.builders import TINY_TARGETS, packed_row, random_docs, stack_rows
from tests.probe_draft import NextTokenProbe

ROOT = Path(__file__).resolve().parents[2]
# A DFlash checkpoint written by an earlier release (no digest): it must still export.
OLD_CHECKPOINT = ROOT / "tests" / "fixtures" / "layout_d429c0e" / "dflash.ckpt"


def loader() -> torch.utils.data.DataLoader:
    rows = [stack_rows([packed_row(random_docs([5, 7], seed=i), 16)]) for i in range(3)]
    return torch.utils.data.DataLoader([{k: v[0] for k, v in r.items()} for r in rows], batch_size=1)


def trainer(tmp_path: Path, steps: int) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    fit = trainer(tmp_path, 2)
    fit.fit(NextTokenProbe(TINY_TARGETS["llama"]), loader())
    path = tmp_path / "draft.ckpt"
    fit.save_checkpoint(path)
    return path


def zero_tensor_bytes(path: Path, count: int = 4096) -> None:
    """Overwrite ``count`` bytes in the middle of the largest tensor record of a torch zip checkpoint,
    as a disk error would: the file still loads, the numbers are wrong."""
    with zipfile.ZipFile(path) as archive:
        record = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(path, "r+b") as handle:
        handle.seek(record.header_offset + 30 + len(record.filename.encode()) + len(record.extra))
        start = handle.tell() + record.file_size // 4
        handle.seek(start)
        handle.write(b"\0" * min(count, record.file_size // 2))


def test_a_checkpoint_records_the_digest_of_its_draft_tensors(checkpoint):
    saved = torch.load(checkpoint, weights_only=False)
    assert len(saved["draft_digest"]) == 64
    # An intact checkpoint loads; the digest does not depend on the order of the state dict.
    assert isinstance(
        NextTokenProbe.load_from_checkpoint(checkpoint, target=TINY_TARGETS["llama"]), NextTokenProbe
    )


def test_a_damaged_checkpoint_is_refused_on_load_resume_and_validate(checkpoint, tmp_path):
    zero_tensor_bytes(checkpoint)
    assert torch.load(checkpoint, weights_only=False)["state_dict"]  # torch itself notices nothing
    with pytest.raises(ValueError, match="the checkpoint is damaged"):
        NextTokenProbe.load_from_checkpoint(checkpoint, target=TINY_TARGETS["llama"])
    with pytest.raises(ValueError, match="the checkpoint is damaged"):
        trainer(tmp_path, 4).fit(NextTokenProbe(TINY_TARGETS["llama"]), loader(), ckpt_path=checkpoint)
    with pytest.raises(ValueError, match="the checkpoint is damaged"):
        trainer(tmp_path, 4).validate(NextTokenProbe(TINY_TARGETS["llama"]), loader(), ckpt_path=checkpoint)


def test_a_damaged_export_checkpoint_leaves_nothing_behind(tmp_path):
    # An old checkpoint has no digest, so give it one and then damage it.
    path = tmp_path / "dflash.ckpt"
    module = load_draft_checkpoint(OLD_CHECKPOINT)
    fit = trainer(tmp_path, 0)
    fit.strategy.connect(module)
    saved = torch.load(OLD_CHECKPOINT, weights_only=False)
    module.on_save_checkpoint(saved)
    torch.save(saved, path)
    export_checkpoint(path, tmp_path / "intact")
    zero_tensor_bytes(path)
    with pytest.raises(ValueError, match="the checkpoint is damaged"):
        export_checkpoint(path, tmp_path / "damaged")
    assert not (tmp_path / "damaged").exists()


def test_a_file_that_is_no_checkpoint_is_named(tmp_path):
    garbage = tmp_path / "notes.ckpt"
    garbage.write_text("garbage\n")
    with pytest.raises(ValueError, match="notes.ckpt is not a readable Lightning checkpoint"):
        export_checkpoint(garbage, tmp_path / "out")
    with pytest.raises(FileNotFoundError):
        export_checkpoint(tmp_path / "missing.ckpt", tmp_path / "out")


def test_export_refuses_a_non_empty_directory_and_overwrite_replaces_only_export_files(tmp_path, capsys):
    out = tmp_path / "export"
    export_checkpoint(OLD_CHECKPOINT, out)
    for name in (CONFIG_FILE, WEIGHTS_FILE):  # readable by the serving engine's user too
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o644, name
    stale = out / "model-00001-of-00002.safetensors"
    shutil.copy(out / WEIGHTS_FILE, stale)
    (out / "notes.txt").write_text("mine")
    before = (out / CONFIG_FILE).read_bytes()
    with pytest.raises(ValueError, match="is not empty .*--overwrite"):
        export_checkpoint(OLD_CHECKPOINT, out)
    with pytest.raises(SystemExit):
        main(["export", str(OLD_CHECKPOINT), str(out)])
    assert f"lightning-drafts export: error: {out} is not empty" in capsys.readouterr().err
    assert stale.exists() and (out / CONFIG_FILE).read_bytes() == before  # refused: nothing changed

    main(["export", str(OLD_CHECKPOINT), str(out), "--overwrite"])
    assert sorted(p.name for p in out.iterdir()) == sorted([CONFIG_FILE, WEIGHTS_FILE, "notes.txt"])
    assert (out / "notes.txt").read_text() == "mine"


def test_a_refused_export_leaves_the_destination_as_it_was(tmp_path):
    # Norm gains back at their initialisation: the validator refuses the export as never trained.
    saved = torch.load(OLD_CHECKPOINT, weights_only=False)
    for name, value in saved["state_dict"].items():
        if name.endswith("norm.weight"):
            value.fill_(1.0)
    untrained = tmp_path / "untrained.ckpt"
    torch.save(saved, untrained)
    with pytest.raises(ValueError, match="RMSNorm gains are still exactly 1.0"):
        export_checkpoint(untrained, tmp_path / "refused")
    # No export, no staging left: only the writer lock beside the destination, which stays.
    assert sorted(p.name for p in tmp_path.iterdir()) == [".refused.lock", "untrained.ckpt"]
