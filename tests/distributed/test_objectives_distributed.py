"""The non-default objectives under FSDP2 (chunked, sharded target, checkpointed layers) equal DDP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.hang_guard import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "objective_grads.py"
DRAFTS = ("dflash-dpace", "dflash2-lk-lambda", "eagle3-lambda")


def run_script(*args: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


def test_objectives_under_fsdp2_equal_ddp(tmp_path):
    for strategy in ("ddp", "fsdp2"):
        (tmp_path / strategy).mkdir()
        run_script(str(tmp_path / strategy), strategy)
    for draft in DRAFTS:
        ddp = torch.load(tmp_path / "ddp" / f"{draft}.pt")
        fsdp2 = torch.load(tmp_path / "fsdp2" / f"{draft}.pt")
        assert fsdp2["target_sharded"] and not ddp["target_sharded"], draft
        assert set(fsdp2["grads"]) == set(ddp["grads"]) and ddp["grads"], draft
        for name, grad in ddp["grads"].items():
            assert grad.abs().max() > 0, f"{draft} {name} has no gradient"
            scale = grad.abs().max().item()
            torch.testing.assert_close(
                fsdp2["grads"][name], grad, rtol=1e-5, atol=1e-5 * scale, msg=f"{draft} {name}"
            )
        metrics = {s: json.loads((tmp_path / s / f"{draft}-val.json").read_text()) for s in ("ddp", "fsdp2")}
        assert metrics["ddp"].keys() == metrics["fsdp2"].keys(), draft
        if not draft.startswith("eagle3"):
            assert "val/accept_len_skip_holes" in metrics["ddp"], draft
        for key, value in metrics["ddp"].items():
            assert metrics["fsdp2"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), f"{draft} {key}"
