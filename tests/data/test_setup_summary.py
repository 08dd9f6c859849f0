"""The data module's setup summary reaches the console of a program that configured no logging (the CLI,
a notebook), once, and a flag keeps it quiet; warnings print either way."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.hang_guard import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = """
import sys
from lightning_drafts.datamodules import PackedChatDataModule
data = PackedChatDataModule(max_tokens=64, max_documents=40, cache_dir=sys.argv[1], setup_summary=sys.argv[2] == "on")
data.setup("fit")
data.setup("fit")
"""


def setup_output(tmp_path: Path, summary: str) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", PROGRAM, str(tmp_path / "cache"), summary],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr


def test_the_setup_summary_prints_once_without_any_logging_setup(tmp_path):
    shown = setup_output(tmp_path, "on")
    assert shown.count("train split: 40 documents") == 1, shown
    assert "one training sample (supervised tokens between ⟦ and ⟧)" in shown
    assert "⟦" in shown.split("one training sample", 1)[1]


def test_setup_summary_false_keeps_the_counts_quiet_but_not_the_warnings(tmp_path):
    quiet = setup_output(tmp_path, "off")
    assert "train split: 40 documents" not in quiet and "one training sample" not in quiet
    # max_tokens=64 truncates most chitchat documents: that warning still prints.
    assert "longer than max_tokens=64 were truncated" in quiet
