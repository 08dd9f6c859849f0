"""``lightning-drafts plot``: the curves it draws are the scalars the run's event file holds, written
as real PNG files; a directory without events is refused with what to pass instead."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from torch.utils.tensorboard import SummaryWriter

from lightning_drafts.cli.main import main
from lightning_drafts.cli.plot import plot_run, read_curves

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# Known values, written out: steps and scalars as a fit logs them (train every 5 steps, val every 10).
LOSS = {5: 6.5, 10: 6.1, 15: 5.8, 20: 5.2}
VAL_LOSS = {9: 6.0, 19: 5.4}
ACCEPT = {9: 1.11, 19: 1.47}
BY_POSITION = {0: {9: 0.10, 19: 0.31}, 1: {9: 0.02, 19: 0.22}, 2: {9: 0.0, 19: 0.15}}


def write_run(directory: Path, scale: float = 1.0) -> Path:
    writer = SummaryWriter(str(directory))
    for step, value in LOSS.items():
        writer.add_scalar("train/loss", value * scale, step)
    for step, value in VAL_LOSS.items():
        writer.add_scalar("val/loss", value * scale, step)
    for step, value in ACCEPT.items():
        writer.add_scalar("val/accept_len", value * scale, step)
    for position, points in BY_POSITION.items():
        for step, value in points.items():
            writer.add_scalar(f"val/acc_pos{position}", value * scale, step)
    writer.add_scalar("train/real_tokens_per_s", 123.0, 5)  # not plotted
    writer.close()
    return directory


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG file"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def series(points: dict[int, float]) -> list[tuple[int, float]]:
    return [(step, pytest.approx(value)) for step, value in sorted(points.items())]


def test_plot_draws_the_event_files_scalars_into_png_files(tmp_path):
    run = write_run(tmp_path / "runs" / "eagle3" / "version_0")
    plots = plot_run(run, tmp_path / "plots")

    names = sorted(f.name for f in plots.files)
    assert names == ["accept_len.png", "acceptance_by_position.png", "loss.png", "summary.png"]
    for file in plots.files:
        width, height = png_size(file)
        assert width > 100 and height > 100
    curves = plots.curves
    assert curves.loss == {"train/loss": series(LOSS), "val/loss": series(VAL_LOSS)}
    assert curves.accept_len == {"val/accept_len": series(ACCEPT)}
    assert curves.by_position == {k: series(v) for k, v in BY_POSITION.items()}


def test_a_run_that_logs_tokens_seen_gets_accept_len_by_tokens(tmp_path):
    run = write_run(tmp_path / "run")
    writer = SummaryWriter(str(run))
    for step in LOSS:  # 1,000 real tokens per step, logged at the training steps only
        writer.add_scalar("train/tokens_seen", 1000.0 * (step + 1), step)
    writer.close()
    plots = plot_run(run, tmp_path / "plots")
    assert png_size(tmp_path / "plots" / "accept_len_by_tokens.png")[0] > 100
    # Validation steps 9 and 19 fall between logged steps: placed on the line, 1,000 tokens per step.
    by_tokens = plots.curves.accept_len_by_tokens()
    assert by_tokens == {"val/accept_len": [(10000, pytest.approx(1.11)), (20000, pytest.approx(1.47))]}
    assert read_curves(write_run(tmp_path / "without")).accept_len_by_tokens() == {}


def test_the_cli_takes_the_newest_version_under_a_run_directory(tmp_path, capsys):
    write_run(tmp_path / "eagle3" / "version_0", scale=2.0)
    write_run(tmp_path / "eagle3" / "version_10")  # newer than version_2 by number, not by name
    write_run(tmp_path / "eagle3" / "version_2", scale=3.0)
    main(["plot", str(tmp_path / "eagle3"), "--out", str(tmp_path / "out"), "--title", "EAGLE-3"])
    assert "version_10" in capsys.readouterr().out
    assert read_curves(tmp_path / "eagle3").accept_len == {"val/accept_len": series(ACCEPT)}
    assert png_size(tmp_path / "out" / "summary.png")[0] > png_size(tmp_path / "out" / "loss.png")[0]


def test_a_directory_without_events_is_refused_with_what_to_pass(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no TensorBoard event file.*runs/eagle3/version_0"):
        plot_run(tmp_path / "empty", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    writer = SummaryWriter(str(tmp_path / "other"))
    writer.add_scalar("something/else", 1.0, 0)
    writer.close()
    with pytest.raises(ValueError, match="logs none of"):
        plot_run(tmp_path / "other", tmp_path / "out")
