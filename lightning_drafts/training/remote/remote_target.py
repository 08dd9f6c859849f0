"""RemoteTarget: the frozen target on Ray actors (its own GPUs or machines), serving one trainer rank.

The trainer sends each planned micro-batch (a :class:`~lightning_drafts.training.remote.unit_ledger.Unit`: the
token rows its loader will yield) to a :class:`~lightning_drafts.training.remote.target_worker.TargetWorker`
ahead of need, up to ``prefetch`` units and ``max_bytes_in_flight`` bytes of results (a slow trainer
stalls the workers, a slow worker stalls the trainer, memory stays bounded). Results travel through Ray's
object store and are taken once each (:class:`UnitLedger`); a unit whose worker died, whose result was
lost, or (with ``unit_timeout_s``) that is late is sent again, to the least busy worker, at most
``max_attempts`` times in all, then the run stops naming the unit's documents. Workers restart themselves
(``max_restarts=-1``); their tasks run at most once (Ray's own task retries are off: the ledger decides).

Ray is imported here only when a RemoteTarget starts, so nothing else needs it installed
(``pip install "lightning-drafts[ray]"``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from lightning_drafts.training.remote.target_worker import TargetWorker
from lightning_drafts.training.remote.unit_ledger import Unit, UnitLedger
from lightning_drafts.training.remote.worker_identity import fingerprint_mismatch, identity_mismatch

logger = logging.getLogger("lightning_drafts.training")

# How long one wait for a result blocks before the late units are looked at again.
POLL_S = 0.05
# Ray starts its worker processes at niceness 15 (its `worker_niceness`): on a machine that also runs other
# work, a target worker then gets the CPU only when nothing else wants it, and the trainer, which waits on
# it, starves with it. The workers are the run's critical path, so a Ray started here runs them at 0.
WORKER_NICENESS = 0


# Ray's logger for its token-authentication notices.
RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"


class _TokenAuthEnabledNotice(logging.Filter):
    """Drops Ray's warning that the local cluster it starts has token authentication on: the cluster is
    this process's own and the secure default is what it should run with, so the line asks nothing of the
    user. Every other notice of that logger (authentication off, a missing token) still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Token authentication is enabled for this Ray cluster")


def start_local_ray(num_cpus: int) -> None:
    """Start a Ray for this process with ``num_cpus`` worker slots and its workers at normal priority."""
    import ray

    notices, quiet = logging.getLogger(RAY_AUTH_LOGGER), _TokenAuthEnabledNotice()
    notices.addFilter(quiet)
    try:
        ray.init(
            num_cpus=num_cpus,
            include_dashboard=False,
            log_to_driver=False,
            _system_config={"worker_niceness": WORKER_NICENESS},
        )
    finally:
        notices.removeFilter(quiet)


@dataclass
class _Attempt:
    unit: Unit
    worker: int
    sequence: int
    sent_at: float
    # The task its worker was running when it was first seen failing: the one failure counted.
    culprit: bool = False


class RemoteTarget:
    """Target workers on Ray for one trainer rank.

    Args:
        worker_args: the :class:`TargetWorker` arguments (target, attn_backend, dtype, seed, layer_ids,
            final_positions, threads).
        workers: how many workers to start.
        address: a Ray cluster's address (``ray start --head`` prints it; ``"auto"`` finds a local one);
            ``None`` starts a local Ray for this process (or uses the one already started in it).
        prefetch: units sent ahead of the one being trained on.
        max_bytes_in_flight: cap on the result bytes in flight or ready (one unit is always allowed).
        max_attempts: sends of one unit before the run stops.
        unit_timeout_s: send a unit again when its result is this late (``None``: only when its worker died).
        worker_gpus: GPUs per worker (Ray places each on a GPU of a node that has one).
        describe: names a unit's documents in the error that stops the run.
        worker_class: the actor's class (a :class:`TargetWorker`).
    """

    def __init__(
        self,
        worker_args: Mapping[str, Any],
        *,
        workers: int,
        address: str | None = None,
        prefetch: int = 4,
        max_bytes_in_flight: int = 256 * 2**20,
        max_attempts: int = 3,
        unit_timeout_s: float | None = None,
        worker_gpus: float = 0.0,
        describe: Callable[[Unit], str] | None = None,
        worker_class: type = TargetWorker,
    ) -> None:
        if int(workers) < 1:
            raise ValueError(f"remote.workers = {workers}; a remote target needs at least 1 worker")
        if int(prefetch) < 0 or int(max_attempts) < 1 or int(max_bytes_in_flight) < 1:
            raise ValueError(
                f"prefetch = {prefetch} (>= 0), max_attempts = {max_attempts} (>= 1) and max_bytes_in_flight = "
                f"{max_bytes_in_flight} (>= 1) out of range"
            )
        self.worker_args = dict(worker_args)
        self.num_workers = int(workers)
        self.address = address
        self.prefetch = int(prefetch)
        self.max_bytes_in_flight = int(max_bytes_in_flight)
        self.max_attempts = int(max_attempts)
        self.unit_timeout_s = unit_timeout_s
        self.worker_gpus = float(worker_gpus)
        self.describe = describe or str
        self.worker_class = worker_class
        self.ledger = UnitLedger()
        self.workers: list[Any] = []
        self.identities: list[dict[str, Any]] = []
        self.retries = 0
        self.last_wait_s = 0.0
        self._failures: dict[Unit, int] = {}
        self._late: dict[Unit, int] = {}
        self._sequence = 0
        # Workers seen failing, until they answer again (their ping), and units waiting for a live worker.
        self._down: dict[int, Any] = {}
        self._unsent: list[Unit] = []
        self._outstanding: dict[Any, _Attempt] = {}
        self._current: dict[Unit, _Attempt] = {}
        self._rows: dict[Unit, dict[str, Tensor]] = {}
        self._expected: dict[Unit, int] = {}

    # --- workers ---------------------------------------------------------------------------------

    def start(self, expected: Mapping[str, Any]) -> None:
        """Start Ray (or join the cluster), start the workers, and refuse any whose identity differs from
        ``expected`` (the trainer's own target, layers, backend and torch) in a field of
        :data:`~lightning_drafts.training.remote.worker_identity.CHECKED_FIELDS`, naming the field."""
        import ray

        if not ray.is_initialized():
            if self.address is None:
                start_local_ray(self.num_workers)
            else:
                ray.init(address=self.address, include_dashboard=False, log_to_driver=False)
        actor = ray.remote(self.worker_class).options(
            num_cpus=1, num_gpus=self.worker_gpus, max_restarts=-1, max_task_retries=0
        )
        self.workers = [actor.remote(**self.worker_args) for _ in range(self.num_workers)]
        self.identities = ray.get([worker.identity.remote() for worker in self.workers])
        for index, identity in enumerate(self.identities):
            refused = identity_mismatch(index, identity, expected) or fingerprint_mismatch(
                index, identity, self.identities[0]
            )
            if refused is not None:
                self.close()
                raise ValueError(refused)

    def where(self) -> str:
        """Where the target runs, for the setup summary."""
        place = f"the Ray cluster at {self.address}" if self.address else "a local Ray"
        backend = self.identities[0]["resolved_backend"] if self.identities else "?"
        return (
            f"target: {self.num_workers} Ray worker(s) on {place} ({backend} attention, prefetch "
            f"{self.prefetch} units, at most {self.max_bytes_in_flight / 2**20:.0f} MiB in flight)"
        )

    def worker_pids(self) -> list[int]:
        import ray

        return ray.get([worker.pid.remote() for worker in self.workers])

    def close(self) -> None:
        import ray

        for worker in self.workers:
            ray.kill(worker)
        self.workers = []
        self._outstanding.clear()
        self._current.clear()

    # --- units -----------------------------------------------------------------------------------

    def offer(self, unit: Unit, rows: Mapping[str, Tensor], expected_bytes: int, force: bool = False) -> bool:
        """Send ``unit`` (its token ``rows``) unless it is known or (unless ``force``: the unit needed now)
        the cap would be passed. Whether it is now known (sent before or now)."""
        if self.ledger.known(unit):
            return True
        if not force and self.ledger.units and self.ledger.bytes + expected_bytes > self.max_bytes_in_flight:
            return False
        self._send(unit, dict(rows), expected_bytes)
        return True

    def take(self, unit: Unit, rows: Mapping[str, Tensor], expected_bytes: int) -> dict[str, Tensor]:
        """``unit``'s features (sent now if it was not), once; blocks until they are here. Results that
        arrived meanwhile, of any unit, are taken into the ledger first (duplicates dropped)."""
        started = time.monotonic()
        if not self.ledger.known(unit):
            self._send(unit, dict(rows), expected_bytes)
        sent = self._rows.get(unit)
        if sent is not None and not sent["input_ids"].equal(rows["input_ids"]):
            raise ValueError(
                f"{unit} was sent with other tokens than the loader now gives for it ({self.describe(unit)}); "
                "the plan changed under the run"
            )
        self._receive(block=False)
        while unit not in self.ledger.ready:
            self._receive(block=True)
        self.last_wait_s = time.monotonic() - started
        self._rows.pop(unit, None)
        self._expected.pop(unit, None)
        return self.ledger.take(unit)

    def forget(self, split: str) -> None:
        """Stop waiting for the units of ``split`` not trained on (see ``UnitLedger.forget``)."""
        for unit in self.ledger.forget(split):
            for table in (self._current, self._rows, self._expected, self._failures, self._late):
                table.pop(unit, None)
            if unit in self._unsent:
                self._unsent.remove(unit)

    def _send(self, unit: Unit, rows: dict[str, Tensor], expected_bytes: int) -> None:
        self._rows[unit] = rows
        self._expected[unit] = expected_bytes
        self.ledger.sent(unit, expected_bytes)
        self._dispatch(unit)

    def _dispatch(self, unit: Unit, avoid: int | None = None) -> None:
        """Give ``unit`` to the least busy live worker (not ``avoid`` if another is live), or keep it until
        one is."""
        live = [w for w in range(len(self.workers)) if w not in self._down]
        if not live:
            self._unsent.append(unit)
            return
        busy = dict.fromkeys(live, 0)
        for attempt in self._outstanding.values():
            if attempt.worker in busy:
                busy[attempt.worker] += 1
        worker = min(live, key=lambda w: (w == avoid, busy[w], w))
        if unit in self._current:
            self.retries += 1
        self._sequence += 1
        attempt = _Attempt(unit, worker, self._sequence, time.monotonic())
        self._outstanding[self.workers[worker].features.remote(unit, self._rows[unit])] = attempt
        self._current[unit] = attempt

    def _blame(self, unit: Unit, why: str) -> None:
        """Count a failed attempt against ``unit``; stop the run after ``max_attempts``."""
        self._failures[unit] = self._failures.get(unit, 0) + 1
        if self._failures[unit] >= self.max_attempts:
            raise RuntimeError(
                f"{unit} failed {self.max_attempts} times on the target workers; the run stops rather than skip "
                f"it: {self.describe(unit)}; last failure: {why}"
            )

    def _receive(self, block: bool) -> None:
        """Take the results that are here (``block``: wait up to :data:`POLL_S` for one), learn which
        failed workers are back, send again the units whose worker failed and, with ``unit_timeout_s``,
        those that are late."""
        import ray
        from ray.exceptions import RayError

        pings = {ref: worker for worker, ref in self._down.items()}
        refs = [*self._outstanding, *pings]
        if refs:
            count, timeout = (1, POLL_S) if block else (len(refs), 0)
            ready, _ = ray.wait(refs, num_returns=count, timeout=timeout)
        else:
            ready = []
        for ref in ready:
            if ref in pings:
                self._pinged(pings[ref], ref)
                continue
            attempt = self._outstanding.pop(ref)
            try:
                unit, features = ray.get(ref)
            except RayError as error:
                self._failed(attempt, error)
                continue
            if self.ledger.arrived(unit, features):
                self._current.pop(unit, None)
        while self._unsent and len(self._down) < len(self.workers):
            self._dispatch(self._unsent.pop(0))
        if self.unit_timeout_s is not None:
            self._resend_late()

    def _pinged(self, worker: int, ref: Any) -> None:
        import ray
        from ray.exceptions import RayError

        try:
            ray.get(ref)
        except RayError:
            # Still restarting: ask again shortly.
            time.sleep(POLL_S)
            self._down[worker] = self.workers[worker].pid.remote()
        else:
            del self._down[worker]

    def _resend_late(self) -> None:
        now = time.monotonic()
        for unit, attempt in list(self._current.items()):
            late = now - attempt.sent_at
            # A late unit is no failure: it is sent again at most max_attempts - 1 times, then awaited.
            resends = self._late.get(unit, 0)
            if (
                unit in self.ledger.in_flight
                and late > self.unit_timeout_s
                and resends < self.max_attempts - 1
            ):
                if unit in self._unsent:
                    continue
                logger.warning("%s is %.1f s late on worker %d; sending it again", unit, late, attempt.worker)
                self._late[unit] = resends + 1
                self._dispatch(unit, avoid=attempt.worker)

    def _failed(self, attempt: _Attempt, error: Exception) -> None:
        """A worker failed ``attempt``. Its tasks run in order, so the earliest one still unanswered was
        running and is blamed; those queued behind it (or sent before its failure was seen) are sent again
        without counting against them. The worker gets no unit until it answers a ping."""
        unit = attempt.unit
        worker = attempt.worker
        if worker not in self._down:
            self._down[worker] = self.workers[worker].pid.remote()
            suspects = [a for a in self._outstanding.values() if a.worker == worker] + [attempt]
            min(suspects, key=lambda a: a.sequence).culprit = True
        if attempt.culprit and unit in self.ledger.in_flight:
            logger.warning(
                "%s failed on worker %d (%s); sending it again", unit, worker, type(error).__name__
            )
            self._blame(unit, f"{type(error).__name__}: {error}")
        if self._current.get(unit) is not attempt or unit not in self.ledger.in_flight:
            return  # an earlier attempt of a unit already sent again, or already here
        self._dispatch(unit)
