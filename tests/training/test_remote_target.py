"""The target on its own Ray workers (``remote.workers``): exact, nothing lost, nothing duplicated, cached.

The Ray checks run in one subprocess (tests/scripts/remote_target_checks.py) that starts one local Ray and
real worker processes for all of them; each test below reads its checks' lines from that one run. The
ledger's rules and the options' refusals are checked here directly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_drafts.training.remote.unit_ledger import Unit, UnitLedger
from tests.support.hang_guard import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "remote_target_checks.py"
CONFIGS = [
    f"configs/quickstart/{name}.yaml" for name in ("eagle3", "mla_eagle3", "dflash", "dflash2", "dspark")
]


@pytest.fixture(scope="module")
def checks() -> str:
    """The output of one run of every Ray check (one Ray start for all)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *CONFIGS],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:]
    return done.stdout + done.stderr


def test_the_local_ray_starts_without_its_token_authentication_notice(checks):
    # Ray 2.60 starts a local cluster with token authentication on and warns that it did: the cluster is
    # the run's own, so the line asks nothing of the user and is dropped; Ray's other notices stay.
    assert "Started a local Ray instance" in checks, checks[-3000:]
    assert "Token authentication is enabled" not in checks, checks[-3000:]


def test_importing_the_library_does_not_import_ray(checks):
    assert "OK the library imports without ray" in checks, checks


def test_two_workers_train_every_family_as_the_co_located_target(checks):
    for config in CONFIGS:
        assert f"OK exact {config}" in checks, checks


def test_validation_and_served_acceptance_through_the_workers_equal_the_co_located_run(checks):
    assert "OK validation through the workers" in checks and "val/served_accept_len" in checks, checks


def test_killed_workers_and_a_delayed_duplicate_lose_or_duplicate_nothing(checks):
    for check in (
        "OK killed before, while and after replying",
        "OK bytes in flight peaked",
        "OK delayed duplicate dropped",
        "OK always-failing unit stops the run",
        "OK mismatched worker refused",
    ):
        assert check in checks, checks


def test_the_cached_epochs_equal_training_from_a_capture_of_the_same_documents(checks):
    assert "OK cached epochs equal the capture's" in checks, checks


def test_a_killed_trainer_resumes_to_the_uninterrupted_draft(checks):
    assert "OK resumed from step 2" in checks, checks
    assert "OK trainer killed mid step 2, resumed from steps 2 and 1" in checks, checks


def test_two_trainer_ranks_each_train_on_exactly_their_own_units(checks):
    assert "OK two ranks each trained on their own units exactly" in checks, checks


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


def test_a_cache_without_workers_or_of_an_unknown_dtype_is_refused_naming_the_option():
    from lightning_drafts.cli.fit import build_from_config

    config = [
        "--config",
        CONFIGS[0],
        "--data.init_args.max_documents=4",
        "--data.init_args.setup_summary=false",
    ]
    with pytest.raises(ValueError, match=r"remote.cache_dir = 'x' caches what target workers send"):
        build_from_config([*config, "--model.init_args.remote.cache_dir=x"])
    with pytest.raises(ValueError, match=r"dtype 'int8' cannot store features"):
        build_from_config(
            [*config, "--model.init_args.remote.workers=1", "--model.init_args.remote.cache_dtype=int8"]
        )
    with pytest.raises(ValueError, match=r"remote.unit_timeout_s"):
        build_from_config(
            [*config, "--model.init_args.remote.workers=1", "--model.init_args.remote.unit_timeout_s=0"]
        )
