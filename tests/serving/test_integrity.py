"""Nothing lost or silently wrong: a damaged checkpoint is refused wherever it is loaded, and an export
never lands over other files unless asked, and then replaces only export files."""

from __future__ import annotations

import re
import shutil
import stat
import zipfile
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_drafts.cli.main import main
from lightning_drafts.core.digest import value_digest
from lightning_drafts.serving.export_files import CARD_FILE, CONFIG_FILE, WEIGHTS_FILE
from lightning_drafts.workflows.export import export_checkpoint, load_draft_checkpoint
from tests.support.builders import TINY_TARGETS, packed_row, random_docs, stack_rows
from tests.support.probe_draft import NextTokenProbe

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


def damage_tensor(path: Path, tensor: torch.Tensor, count: int = 4096) -> None:
    """Flip ``count`` bytes (all, if fewer) in the middle of the storage record holding exactly
    ``tensor``'s bytes in a torch zip checkpoint, as a disk error would: the file still loads."""
    wanted = tensor.contiguous().view(torch.uint8).numpy().tobytes()
    with zipfile.ZipFile(path) as archive:
        (record,) = [i for i in archive.infolist() if "/data/" in i.filename and archive.read(i) == wanted]
    with open(path, "r+b") as handle:
        start = record.header_offset + 30 + len(record.filename.encode()) + len(record.extra)
        length = min(count, record.file_size)
        handle.seek(start + (record.file_size - length) // 2)
        chunk = handle.read(length)
        handle.seek(start + (record.file_size - length) // 2)
        handle.write(bytes(b ^ 0xFF for b in chunk))


def test_a_checkpoint_records_a_digest_of_every_section(checkpoint, tmp_path):
    saved = torch.load(checkpoint, weights_only=False)
    sections = {"state_dict", "optimizer_states", "lr_schedulers", "loops", "callbacks", "hyper_parameters"}
    assert sections <= set(saved["checkpoint_digest"])
    # An intact checkpoint loads with every tensor as saved, and resumes; the digests do not depend on the
    # order of the state dict (another writer's order), but a renamed tensor changes them.
    state = saved["state_dict"]
    assert len(state) > 1
    loaded = NextTokenProbe.load_from_checkpoint(checkpoint, target=TINY_TARGETS["llama"])
    for name, tensor in state.items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    reordered = dict(reversed(list(state.items())))
    assert list(reordered) != list(state)
    assert value_digest(reordered) == saved["checkpoint_digest"]["state_dict"]
    renamed = {(name + "_renamed" if i == 0 else name): t for i, (name, t) in enumerate(state.items())}
    assert value_digest(renamed) != saved["checkpoint_digest"]["state_dict"]
    saved["state_dict"] = reordered
    torch.save(saved, tmp_path / "reordered.ckpt")
    trainer(tmp_path, 3).fit(
        NextTokenProbe(TINY_TARGETS["llama"]), loader(), ckpt_path=tmp_path / "reordered.ckpt"
    )


def test_a_damaged_checkpoint_is_refused_on_load_resume_and_validate(checkpoint, tmp_path):
    zero_tensor_bytes(checkpoint)
    assert torch.load(checkpoint, weights_only=False)["state_dict"]  # torch itself notices nothing
    damaged = "draft.ckpt is damaged: state_dict|the checkpoint is damaged: state_dict"
    with pytest.raises(ValueError, match=damaged):
        NextTokenProbe.load_from_checkpoint(checkpoint, target=TINY_TARGETS["llama"])
    with pytest.raises(ValueError, match=damaged):
        trainer(tmp_path, 4).fit(NextTokenProbe(TINY_TARGETS["llama"]), loader(), ckpt_path=checkpoint)
    with pytest.raises(ValueError, match=damaged):
        trainer(tmp_path, 4).validate(NextTokenProbe(TINY_TARGETS["llama"]), loader(), ckpt_path=checkpoint)


def test_a_checkpoint_without_its_weights_is_refused_outside_the_cli_naming_them(checkpoint, tmp_path):
    # Lightning itself reads checkpoint["state_dict"] after the module's hook: a bare KeyError without it.
    saved = torch.load(checkpoint, weights_only=False)
    del saved["state_dict"]
    cut = tmp_path / "cut.ckpt"
    torch.save(saved, cut)
    with pytest.raises(ValueError, match="damaged: state_dict"):
        NextTokenProbe.load_from_checkpoint(cut, target=TINY_TARGETS["llama"])
    with pytest.raises(ValueError, match="damaged: state_dict"):
        trainer(tmp_path, 4).fit(NextTokenProbe(TINY_TARGETS["llama"]), loader(), ckpt_path=cut)
    # Without its digests too (a checkpoint written before they were recorded): refused by name.
    del saved["checkpoint_digest"], saved["checkpoint_digested"]
    torch.save(saved, cut)
    with pytest.raises(ValueError, match="holds no state_dict"):
        trainer(tmp_path, 4).validate(NextTokenProbe(TINY_TARGETS["llama"]), loader(), ckpt_path=cut)


def test_flipped_bytes_in_the_adam_state_are_refused_on_resume_naming_it(checkpoint, tmp_path):
    saved = torch.load(checkpoint, weights_only=False)
    moments = [s["exp_avg_sq"] for s in saved["optimizer_states"][0]["state"].values()]
    damage_tensor(checkpoint, max(moments, key=torch.Tensor.numel))
    # The weights are intact: only the optimizer state is named.
    with pytest.raises(ValueError, match=r"damaged: optimizer_states \(the optimizer state") as refused:
        trainer(tmp_path, 4).fit(NextTokenProbe(TINY_TARGETS["llama"]), loader(), ckpt_path=checkpoint)
    assert "state_dict" not in str(refused.value)


def test_a_checkpoint_of_another_family_is_refused_naming_both(tmp_path, capsys):
    # The config's family differs from the checkpoint's: refused (one message, no traceback) before
    # LightningCLI builds the checkpoint's family from its hyperparameters instead.
    dflash = ROOT / "configs" / "quickstart" / "dflash.yaml"
    eagle3 = ROOT / "tests" / "fixtures" / "layout_d429c0e" / "eagle3.ckpt"
    with pytest.raises(SystemExit) as exit_:
        main(["validate", f"--config={dflash}", f"--ckpt_path={eagle3}", "--trainer.logger=false"])
    assert exit_.value.code == 2
    assert re.search(
        r"eagle3.ckpt holds a Eagle3Module draft .* model is DFlashModule", capsys.readouterr().err
    )
    # A module asked to restore another family's checkpoint (fit --ckpt_path last finds one) refuses too.
    with pytest.raises(ValueError, match=r"holds a DFlashModule draft .* model is NextTokenProbe"):
        trainer(tmp_path, 1).fit(NextTokenProbe(TINY_TARGETS["llama"]), loader(), ckpt_path=OLD_CHECKPOINT)


def test_validate_with_the_logger_off_writes_nothing_into_the_current_directory(tmp_path, monkeypatch):
    work, cache = tmp_path / "work", tmp_path / "cache"
    work.mkdir()
    monkeypatch.chdir(work)
    dflash = ROOT / "configs" / "quickstart" / "dflash.yaml"
    main(
        [
            "validate",
            f"--config={dflash}",
            "--trainer.logger=false",
            "--trainer.limit_val_batches=1",
            "--trainer.enable_progress_bar=false",
            "--data.init_args.max_documents=60",
            "--data.init_args.val_fraction=0.1",
            f"--data.init_args.cache_dir={cache}",
        ]
    )
    assert sorted(p.name for p in work.iterdir()) == []


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
    with pytest.raises(ValueError, match="dflash.ckpt is damaged: state_dict"):
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
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [CONFIG_FILE, WEIGHTS_FILE, CARD_FILE, "notes.txt"]
    )
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


def refusal(capsys, *args: str) -> str:
    """The one line a command exits with (status 2, no traceback) on ``args``."""
    with pytest.raises(SystemExit) as exit_:
        main(list(args))
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [line for line in err.splitlines() if line.startswith("lightning-drafts ")]
    return line


@pytest.mark.parametrize("section", ["state_dict", "optimizer_states", "lr_schedulers", "loops", "callbacks"])
def test_a_checkpoint_missing_a_whole_section_is_refused_naming_the_file_and_the_section(
    checkpoint, tmp_path, section, capsys
):
    # A section dropped whole (a writer that stopped early, an edit) leaves no damaged bytes to see.
    saved = torch.load(checkpoint, weights_only=False)
    del saved[section]
    cut = tmp_path / "cut.ckpt"
    torch.save(saved, cut)
    line = refusal(capsys, "export", str(cut), str(tmp_path / "export"))
    assert line.startswith(f"lightning-drafts export: error: {cut} is damaged: {section} ("), line
    assert not (tmp_path / "export").exists()
    # Resuming from it is refused the same way, before the model is built.
    eagle3 = ROOT / "configs" / "quickstart" / "eagle3.yaml"
    line = refusal(capsys, "fit", f"--config={eagle3}", f"--ckpt_path={cut}", "--trainer.logger=false")
    assert line.startswith(f"lightning-drafts fit: error: {cut} is damaged: {section} ("), line


def test_a_checkpoint_whose_digests_were_removed_is_refused_and_one_that_never_had_them_is_named(
    checkpoint, tmp_path, capsys
):
    saved = torch.load(checkpoint, weights_only=False)
    del saved["checkpoint_digest"]
    stripped = tmp_path / "stripped.ckpt"
    torch.save(saved, stripped)
    line = refusal(capsys, "export", str(stripped), str(tmp_path / "export"))
    assert line.startswith(
        f"lightning-drafts export: error: {stripped} was written with digests of its sections but holds none"
    ), line
    with pytest.raises(ValueError, match="was written with digests of its sections but holds none"):
        NextTokenProbe.load_from_checkpoint(stripped, target=TINY_TARGETS["llama"])
    assert not (tmp_path / "export").exists()
    # Resuming from it is refused the same way, before the model is built.
    eagle3 = ROOT / "configs" / "quickstart" / "eagle3.yaml"
    line = refusal(capsys, "fit", f"--config={eagle3}", f"--ckpt_path={stripped}", "--trainer.logger=false")
    assert line.startswith(f"lightning-drafts fit: error: {stripped} was written with digests"), line
    # A checkpoint of a release that wrote no digests still exports, and says that it is read unverified.
    with pytest.warns(UserWarning, match=r"records no digests .*: its sections are read unverified"):
        export_checkpoint(OLD_CHECKPOINT, tmp_path / "old")
