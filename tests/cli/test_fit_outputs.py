"""What a fit leaves behind: a resumable last.ckpt even without validation, one run directory per fit even
when two start together, checkpoints written through the atomic CheckpointIO, and a resume that refuses a
command line changing the run it continues (and applies one changing only how it runs)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch
import yaml

from lightning_drafts.cli.main import main, run_cli
from lightning_drafts.cli.run_claim import claim_next_version, claim_run_directory
from lightning_drafts.training.atomic_checkpoint_io import AtomicCheckpointIO

ROOT = Path(__file__).resolve().parents[2]
EAGLE3 = ROOT / "configs" / "quickstart" / "eagle3.yaml"


def tiny_fit(out: Path, *overrides: str) -> list[str]:
    """The EAGLE-3 quickstart without validation, shrunk to seconds: 2 steps of 2 rows of 96 tokens."""
    return [
        "fit",
        f"--config={EAGLE3}",
        "--trainer.max_steps=2",
        "--trainer.log_every_n_steps=1",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        f"--trainer.logger.init_args.save_dir={out / 'runs'}",
        "--data.init_args.val_fraction=0",
        "--data.init_args.max_documents=60",
        "--data.init_args.max_tokens=96",
        "--data.init_args.batch_size=2",
        f"--data.init_args.cache_dir={out / 'cache'}",
        "--model.init_args.draft_vocab_size=256",
        *overrides,
    ]


@pytest.fixture(scope="module")
def unvalidated(tmp_path_factory) -> tuple[Path, Path, str]:
    """``(out, its last.ckpt, the fit's log)`` of a fit that never validates."""
    import logging

    out = tmp_path_factory.mktemp("unvalidated")
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("lightning.pytorch")
    logger.addHandler(handler)
    try:
        cli = run_cli(tiny_fit(out))
    finally:
        logger.removeHandler(handler)
    assert isinstance(cli.trainer.strategy.checkpoint_io, AtomicCheckpointIO)
    return out, out / "runs" / "eagle3" / "version_0" / "checkpoints" / "last.ckpt", "\n".join(records)


def test_a_fit_without_validation_saves_its_last_step_and_says_best_cannot_exist(unvalidated):
    out, last, log = unvalidated
    assert sorted(p.name for p in last.parent.iterdir()) == ["last.ckpt"]
    saved = torch.load(last, map_location="cpu", weights_only=False)
    assert saved["global_step"] == 2 and saved["optimizer_states"][0]["state"]
    assert "no validation in this fit: no checkpoint monitored on val/accept_len (best.ckpt) can be" in log


@pytest.mark.parametrize(
    ("override", "field", "given", "saved"),
    [
        ("--model.init_args.learning_rate=0.5", "learning_rate", "0.5", "0.003"),
        ("--model.init_args.draft_vocab_size=128", "draft_vocab_size", "128", "256"),
    ],
)
@pytest.mark.parametrize("resume", ["file", "last"])
def test_a_resume_that_changes_the_run_is_refused_in_one_line(
    unvalidated, resume, override, field, given, saved, capsys, monkeypatch
):
    out, last, _ = unvalidated
    ckpt_path = str(last) if resume == "file" else "last"
    monkeypatch.setattr(
        sys, "argv", ["lightning-drafts", *tiny_fit(out, f"--ckpt_path={ckpt_path}", override)]
    )
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [x for x in err.splitlines() if x.startswith("lightning-drafts fit: error:")]
    assert line.startswith(
        f"lightning-drafts fit: error: model.init_args.{field} = {given} differs from {saved} in the "
        f"checkpoint {last} that --ckpt_path resumes"
    )
    assert line.endswith(f"resume with {field}: {saved}, or start a new fit without --ckpt_path")


def test_a_resume_applies_and_records_a_change_of_how_the_step_runs(unvalidated, tmp_path):
    out, last, _ = unvalidated
    run = tmp_path / "runs" / "eagle3" / "version_0"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(last.read_bytes())
    cli = run_cli(
        tiny_fit(
            tmp_path,
            f"--ckpt_path={run / 'checkpoints' / 'last.ckpt'}",
            "--trainer.max_steps=3",
            "--model.init_args.draft_attn_backend=eager",
        )
    )
    assert cli.model.hparams.draft_attn_backend == "eager"
    assert cli.trainer.global_step == 3
    # The resumed fit continued the run it resumed (no new version claimed) and recorded the change there.
    assert sorted(p.name for p in run.parent.iterdir()) == ["version_0"]
    recorded = yaml.safe_load((run / "config.yaml").read_text())["model"]["init_args"]
    assert recorded["draft_attn_backend"] == "eager" and recorded["learning_rate"] == 0.003


def test_two_fits_configured_before_either_logs_get_their_own_run_directories(tmp_path):
    # Each fit's logger writes its directory only once it runs: without the claim both take version_0.
    sections = [
        {
            "trainer": {
                "logger": _namespace(
                    class_path="lightning.pytorch.loggers.TensorBoardLogger",
                    init_args={"save_dir": str(tmp_path), "name": "eagle3", "version": None},
                )
            }
        }
        for _ in range(2)
    ]
    assert [claim_run_directory(section) for section in sections] == [0, 1]
    assert [s["trainer"]["logger"].init_args["version"] for s in sections] == [0, 1]
    assert sorted(p.name for p in (tmp_path / "eagle3").iterdir()) == ["version_0", "version_1"]


def test_claims_racing_in_threads_each_get_their_own_version(tmp_path):
    # A tiny switch interval makes the threads interleave between listing the versions and creating one,
    # where two claims that do not create atomically would both take the same number.
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for round_ in range(60):
            won = _race(tmp_path / str(round_), 16)
            assert sorted(won) == list(range(16)), f"round {round_}: {sorted(won)}"
    finally:
        sys.setswitchinterval(previous)


def _race(root: Path, count: int) -> list[int]:
    """The versions ``count`` threads released together claim under ``root``."""
    barrier = threading.Barrier(count)
    won: list[int] = []

    def claim() -> None:
        barrier.wait()
        won.append(claim_next_version(root))

    threads = [threading.Thread(target=claim) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return won


def _namespace(**fields: object) -> object:
    from jsonargparse import Namespace

    return Namespace(**fields)
