"""The target on its own Ray workers (``target_workers``): exact, nothing lost, nothing duplicated.

The Ray checks run as subprocess scripts (tests/scripts/remote_target_checks.py for one trainer,
remote_target_ddp.py for two gloo ranks), each starting one local Ray and real worker processes; the
ledger's rules are checked here directly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_drafts.training.unit_ledger import Unit, UnitLedger
from tests.hang_guard import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "remote_target_checks.py"
CONFIGS = [
    f"configs/quickstart/{name}.yaml" for name in ("eagle3", "mla_eagle3", "dflash", "dflash2", "dspark")
]


def run_checks(*args: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:]
    return done.stdout


def test_two_workers_train_every_family_as_the_co_located_target_and_lose_or_duplicate_nothing():
    # One Ray start for every check.
    out = run_checks(*CONFIGS)
    for config in CONFIGS:
        assert f"OK exact {config}" in out, out
    for check in (
        "OK killed before and after replying",
        "OK bytes in flight peaked",
        "OK delayed duplicate dropped",
        "OK always-failing unit stops the run",
        "OK mismatched worker refused",
    ):
        assert check in out, out


def test_two_trainer_ranks_each_train_on_exactly_their_own_units(tmp_path):
    # Two 2-process gloo runs on one Ray cluster.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tests" / "scripts" / "remote_target_ddp.py"),
            CONFIGS[2],
            str(tmp_path / "out"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:]
    assert "OK two ranks each trained on their own units exactly" in done.stdout, done.stdout


def test_importing_the_library_does_not_import_ray():
    code = (
        "import sys, lightning_drafts, lightning_drafts.training.module, lightning_drafts.cli.fit; "
        "assert 'ray' not in sys.modules, 'ray imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=HANG_GUARD_S)


def unit(step: int, split: str = "train") -> Unit:
    return Unit(split, 0, step, 0, 0)


def features(value: float) -> dict[str, torch.Tensor]:
    return {"target_hidden_states": torch.full((1, 4, 2), value)}


def test_the_ledger_takes_the_first_result_of_a_unit_once_and_drops_duplicates_and_strays():
    ledger = UnitLedger()
    ledger.sent(unit(0), expected_bytes=32)
    ledger.sent(unit(1), expected_bytes=32)
    assert ledger.units == 2 and ledger.bytes == 64
    assert ledger.arrived(unit(1), features(1.0))
    # A second attempt of unit 1 finishing late, a unit never sent (from before a resume).
    assert not ledger.arrived(unit(1), features(9.0))
    assert not ledger.arrived(unit(7), features(9.0))
    assert dict(ledger.dropped) == {"duplicate": 1, "stale": 1}
    assert torch.equal(ledger.take(unit(1))["target_hidden_states"], features(1.0)["target_hidden_states"])
    assert not ledger.arrived(unit(1), features(9.0))
    assert ledger.dropped["duplicate"] == 2
    with pytest.raises(
        ValueError, match=r"train unit \(epoch 0, step 1, rank 0, micro-batch 0\) was already"
    ):
        ledger.take(unit(1))
    with pytest.raises(ValueError, match="was already sent"):
        ledger.sent(unit(1), 32)
    with pytest.raises(ValueError, match="has no result yet"):
        ledger.take(unit(0))
    # Validation units of the same coordinates are other units.
    ledger.sent(unit(1, "val"), 32)
    assert ledger.units == 2 and ledger.peak_units == 2
    assert ledger.peak_bytes == 64
    # A validation run that ends lets its units go; a result that still comes is stale, training's stay.
    assert ledger.forget("val") == [unit(1, "val")]
    assert not ledger.arrived(unit(1, "val"), features(1.0)) and ledger.dropped["stale"] == 2
    assert ledger.units == 1 and ledger.bytes == 32
