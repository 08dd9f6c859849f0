"""SlowStepsNotice: one line, once, when the measured step rate is under the share of the expected one, with
the threads hint; none when it is not. The clock is the test's (two readings, ten steps apart): no duration
of this machine is measured or asserted."""

from __future__ import annotations

import logging
import os

import lightning as L
import pytest
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_drafts.callbacks import SlowStepsNotice
from lightning_drafts.callbacks.slow_steps import machine_load

RANK_ZERO = "lightning.pytorch.utilities.rank_zero"


def notices(
    caplog, expected: float | None, readings: list[float], max_steps: int = 30, load=(1.0, 2)
) -> list[str]:
    clock = iter(readings)
    notice = SlowStepsNotice(expected, steps=10, fraction=0.5, clock=lambda: next(clock), load=lambda: load)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        logger=False,
        limit_val_batches=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[notice],
    )
    with caplog.at_level(logging.INFO, logger=RANK_ZERO):
        trainer.fit(BoringModel())
    # Both readings taken, and no third (the rate is measured once).
    assert next(clock, None) is None
    return [r.getMessage() for r in caplog.records if "steps/s" in r.getMessage()]


def test_a_run_at_a_third_of_the_expected_rate_says_so_once_with_the_threads_hint(caplog):
    # 10 steps between readings 20 s apart: 0.5 steps/s against 1.5 expected (under half).
    (line,) = notices(caplog, expected=1.5, readings=[100.0, 120.0])
    assert line.startswith("training runs at 0.5 steps/s, under 50% of the 1.5 expected on this machine")
    assert "OMP_NUM_THREADS" in line and "OMP_WAIT_POLICY=PASSIVE" in line and "\n" not in line


def test_a_run_at_more_than_half_the_expected_rate_says_nothing(caplog):
    # 10 steps in 20 s: 0.5 steps/s against 0.9 expected (over half).
    assert notices(caplog, expected=0.9, readings=[100.0, 120.0]) == []


def test_without_an_expected_rate_a_load_above_twice_the_cores_is_said_once(caplog):
    # 10 steps in 20 s, load average 5.2 on 2 usable cores: over 2 / 0.5 = 4.
    (line,) = notices(caplog, expected=None, readings=[100.0, 120.0], load=(5.2, 2))
    assert line.startswith("training runs at 0.5 steps/s on a loaded machine (load average 5.2 on 2 usable")
    assert "OMP_NUM_THREADS" in line and "OMP_WAIT_POLICY=PASSIVE" in line and "\n" not in line
    # 3.9 is under 4: the second run adds nothing to what was logged.
    assert notices(caplog, expected=None, readings=[100.0, 120.0], load=(3.9, 2)) == [line]


@pytest.mark.parametrize(
    ("arguments", "refused"),
    [
        ({"expected_steps_per_s": 0.0}, "expected_steps_per_s = 0.0; it must be a rate > 0"),
        ({"expected_steps_per_s": 1.0, "steps": 0}, "steps = 0; it must be at least 1"),
        ({"expected_steps_per_s": 1.0, "fraction": 1.5}, r"fraction = 1.5; it must be in \(0, 1\]"),
    ],
)
def test_settings_that_measure_nothing_are_refused(arguments, refused):
    with pytest.raises(ValueError, match=refused):
        SlowStepsNotice(**arguments)


def test_the_machine_load_is_a_load_average_and_the_usable_cores():
    average, cores = machine_load()
    assert average >= 0.0 and 1 <= cores <= os.cpu_count()
