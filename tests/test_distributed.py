"""Multi-process runs as subprocess scripts (gloo on CPU), never inside the pytest process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def run_script(script: str, *args: str, timeout: int = 300) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "scripts" / script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


def test_ddp_metrics_equal_the_single_process_reference(tmp_path):
    run_script("ddp_validate.py", str(tmp_path / "one.json"), "1")
    run_script("ddp_validate.py", str(tmp_path / "two.json"), "2")
    one = json.loads((tmp_path / "one.json").read_text())
    two = json.loads((tmp_path / "two.json").read_text())
    for key in ("val/accept_len", "val/acc_pos0", "val/valid_tokens"):
        assert two[key] == one[key], key
    assert two["val/loss"] == pytest.approx(one["val/loss"], rel=1e-6)


def test_fsdp2_trains_saves_a_target_free_checkpoint_and_resumes(tmp_path):
    run_script("fsdp2_train.py", str(tmp_path), "train")
    checkpoint = torch.load(tmp_path / "fsdp2.ckpt", weights_only=False)
    assert set(checkpoint["state_dict"]) == {"head.weight", "head.bias"}
    assert json.loads((tmp_path / "train.json").read_text()) == {"global_step": 3, "param_type": "DTensor"}

    run_script("fsdp2_train.py", str(tmp_path), "resume")
    assert json.loads((tmp_path / "resume.json").read_text())["global_step"] == 5
