"""SlowStepsNotice: one line when a fit's optimizer steps run well below the rate expected of the machine,
with what usually explains it on a CPU: a machine shared with other work, and threads that spin.

A training step launches thousands of small operators; with more threads than free cores, or with
libgomp's threads spin-waiting while another job holds a core, a step can take twice as long or more
(``docs/results/throughput.md``) and nothing else says so. The expected rate is the user's (the steps/s
this config makes on this machine when it is idle); without one nothing is measured.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import lightning as L
from lightning.pytorch.utilities import rank_zero_info

THREADS_HINT = (
    "set OMP_NUM_THREADS to the cores this run may use and OMP_WAIT_POLICY=PASSIVE before starting it"
)


class SlowStepsNotice(L.Callback):
    """Measure the step rate over ``steps`` optimizer steps (after the first, which pays one-time costs) and
    say once when it is under ``fraction`` of ``expected_steps_per_s``.

    Args:
        expected_steps_per_s: the rate this run makes on this machine when it is not loaded.
        steps: optimizer steps the rate is measured over.
        fraction: the share of the expected rate under which the run is reported as slow.
        clock: seconds, monotonic (a test passes its own).
    """

    def __init__(
        self,
        expected_steps_per_s: float,
        steps: int = 10,
        fraction: float = 0.5,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if not expected_steps_per_s > 0:
            raise ValueError(
                f"expected_steps_per_s = {expected_steps_per_s}; it must be a rate > 0 (steps/s)"
            )
        if int(steps) < 1:
            raise ValueError(f"steps = {steps}; it must be at least 1 optimizer step to measure over")
        if not 0 < fraction <= 1:
            raise ValueError(f"fraction = {fraction}; it must be in (0, 1]")
        self.expected = float(expected_steps_per_s)
        self.steps = int(steps)
        self.fraction = float(fraction)
        self.clock = clock
        self._began: tuple[int, float] | None = None
        self.measured: float | None = None

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: Any) -> None:
        if self.measured is not None:
            return
        step = int(trainer.global_step)
        if self._began is None:
            if step >= 1:
                self._began = (step, self.clock())
            return
        first, began = self._began
        if step - first < self.steps:
            return
        self.measured = (step - first) / max(self.clock() - began, 1e-9)
        if self.measured < self.fraction * self.expected:
            rank_zero_info(
                f"training runs at {self.measured:.3g} steps/s, under {self.fraction:.0%} of the "
                f"{self.expected:g} expected on this machine: it is likely loaded (other jobs, or more threads "
                f"than free cores); {THREADS_HINT}"
            )
