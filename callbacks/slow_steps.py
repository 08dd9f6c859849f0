"""SlowStepsNotice: one line when a fit's optimizer steps run well below the rate expected of the machine,
with what usually explains it on a CPU: a machine shared with other work, and threads that spin.

A training step launches thousands of small operators; with more threads than free cores, or with
libgomp's threads spin-waiting while another job holds a core, a step can take twice as long or more
(``docs/results/throughput.md``) and nothing else says so. With the user's expected rate (the steps/s this
config makes on this machine when it is idle) the measured rate is compared with it; without one, the
machine's load is: more runnable threads than usable cores, on average over the last minute, means every
thread of this run waits its turn.
"""

from __future__ import annotations

import os
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
    say once when it is under ``fraction`` of ``expected_steps_per_s``, or, with no expected rate, when the
    one-minute load average is above ``1 / fraction`` times the cores this process may use (CPU runs only:
    on an accelerator the host's load says little about the step).

    Args:
        expected_steps_per_s: the rate this run makes on this machine when it is not loaded (None: judge by
            the machine's load).
        steps: optimizer steps the rate is measured over.
        fraction: the share of the expected rate under which the run is reported as slow.
        clock: seconds, monotonic (a test passes its own).
        load: the one-minute load average and the usable cores (a test passes its own).
    """

    def __init__(
        self,
        expected_steps_per_s: float | None = None,
        steps: int = 10,
        fraction: float = 0.5,
        clock: Callable[[], float] = time.perf_counter,
        load: Callable[[], tuple[float, int]] | None = None,
    ) -> None:
        if expected_steps_per_s is not None and not expected_steps_per_s > 0:
            raise ValueError(
                f"expected_steps_per_s = {expected_steps_per_s}; it must be a rate > 0 (steps/s)"
            )
        if int(steps) < 1:
            raise ValueError(f"steps = {steps}; it must be at least 1 optimizer step to measure over")
        if not 0 < fraction <= 1:
            raise ValueError(f"fraction = {fraction}; it must be in (0, 1]")
        self.expected = None if expected_steps_per_s is None else float(expected_steps_per_s)
        self.steps = int(steps)
        self.fraction = float(fraction)
        self.clock = clock
        self.load = load or machine_load
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
        if self.expected is not None:
            if self.measured < self.fraction * self.expected:
                rank_zero_info(
                    f"training runs at {self.measured:.3g} steps/s, under {self.fraction:.0%} of the "
                    f"{self.expected:g} expected on this machine: it is likely loaded (other jobs, or more "
                    f"threads than free cores); {THREADS_HINT}"
                )
        elif pl_module.device.type == "cpu":
            average, cores = self.load()
            if average > cores / self.fraction:
                rank_zero_info(
                    f"training runs at {self.measured:.3g} steps/s on a loaded machine (load average "
                    f"{average:.1f} on {cores} usable cores: threads wait for a core); {THREADS_HINT}"
                )


def machine_load() -> tuple[float, int]:
    """The one-minute load average and the cores this process may run on."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return os.getloadavg()[0], cores
