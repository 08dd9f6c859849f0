"""Disaggregated training: steps per second against the number of target workers, and the shipped
target's wait per step co-located vs on 2 workers.

Part 1, the protocol at scale. The trainer side is the real one (:class:`RemoteTarget`: units sent ahead,
least-busy worker, Ray's object store, the ledger), its workers real Ray actors whose forward has a set
cost per token (``--token-ms`` per token of a ``--tokens``-token unit, spent asleep, as a GPU forward
leaves the host CPU free), and each trainer step costs ``--train-ms`` (asleep too). For W = 1, 2, 4, 8
workers on this machine, steps per second are measured over ``--units-per-worker`` x W steps after a
warmup, beside the bound ``min(W / t_target, 1 / t_train)``. For W beyond one machine (64, 256) a model
of the same protocol gives the figure: a discrete-event run of the trainer and W first-in-first-out
workers, sending ``prefetch`` units ahead to the least busy worker, each unit costing ``t_target`` plus
the per-unit overhead measured in the real runs.

Part 2, the real target. The EAGLE-3 quickstart (its shipped target) trains ``--steps`` steps co-located
and with 2 local workers; reported per step: wall time, the trainer's wait for its features
(``target/wait_s``) and, co-located, the target forward's time inside the step (a forward hook).

    .venv/bin/python benchmarks/disaggregated.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import lightning as L
import torch

from lightning_drafts.cli.fit import build_from_config
from lightning_drafts.training.remote.remote_target import RemoteTarget, start_local_ray
from lightning_drafts.training.remote.unit_ledger import Unit

ROOT = Path(__file__).resolve().parents[1]
QUICKSTART = ROOT / "configs" / "quickstart" / "eagle3.yaml"


class TimedWorker:
    """A target worker whose forward costs ``token_s`` per token (asleep) and returns ``hidden`` float32
    features per token."""

    def __init__(self, token_s: float, hidden: int) -> None:
        self.token_s, self.hidden = token_s, hidden

    def identity(self) -> dict:
        return {"decoder_fingerprint": "timed", "resolved_backend": "none"}

    def pid(self) -> int:
        return os.getpid()

    def features(self, unit, batch):
        tokens = int(batch["input_ids"].numel())
        time.sleep(self.token_s * tokens)
        return unit, {"target_hidden_states": torch.zeros(1, tokens, self.hidden)}


def measured_steps_per_s(workers: int, args: argparse.Namespace) -> tuple[float, float]:
    """(steps per second, mean wait per step) of ``workers`` timed workers and a ``--train-ms`` trainer."""
    prefetch = 2 * workers
    remote = RemoteTarget(
        {"token_s": args.token_ms / 1000, "hidden": args.hidden},
        workers=workers,
        prefetch=prefetch,
        max_bytes_in_flight=2**40,
        worker_class=TimedWorker,
    )
    remote.start({})
    rows = {"input_ids": torch.zeros(1, args.tokens, dtype=torch.long)}
    unit_bytes = args.tokens * args.hidden * 4
    steps = args.warmup + args.units_per_worker * workers
    waits, started = [], None
    for step in range(steps):
        if step == args.warmup:
            started, waits = time.perf_counter(), []
        unit = Unit("train", 0, step, 0, 0)
        remote.offer(unit, rows, unit_bytes, force=True)
        for ahead in range(step + 1, min(step + 1 + prefetch, steps)):
            remote.offer(Unit("train", 0, ahead, 0, 0), rows, unit_bytes)
        remote.take(unit, rows, unit_bytes)
        waits.append(remote.last_wait_s)
        time.sleep(args.train_ms / 1000)
    elapsed = time.perf_counter() - started
    remote.close()
    return (steps - args.warmup) / elapsed, statistics.mean(waits)


def modelled_steps_per_s(workers: int, t_target: float, t_train: float, overhead: float, steps: int) -> float:
    """The protocol as a discrete-event run: at each step the trainer sends the units up to ``2 W`` ahead
    not yet sent, each to the worker with the fewest units not yet answered (first in, first out, ties to
    the lowest index), waits for its own unit, then trains ``t_train``. A unit costs ``t_target +
    overhead`` on its worker."""
    prefetch = 2 * workers
    pending: list[list[float]] = [[] for _ in range(workers)]  # per worker: answer times, in order
    done: dict[int, float] = {}
    sent, now, first = 0, 0.0, 0.0
    warmup = min(2 * workers, steps // 4)
    for step in range(steps):
        while sent < min(step + 1 + prefetch, steps):
            for queue in pending:
                while queue and queue[0] <= now:
                    queue.pop(0)
            worker = min(range(workers), key=lambda w: (len(pending[w]), w))
            queue = pending[worker]
            finish = max(queue[-1] if queue else now, now) + t_target + overhead
            queue.append(finish)
            done[sent] = finish
            sent += 1
        # Timed as the real runs are: from the start of step `warmup` (before its wait) to the end.
        if step == warmup:
            first = now
        now = max(now, done.pop(step)) + t_train
    return (steps - warmup) / (now - first)


class StepClock(L.Callback):
    """Wall time, features wait and (co-located) target forward time of every step."""

    def __init__(self) -> None:
        self.steps: list[float] = []
        self.waits: list[float] = []
        self.forwards: list[float] = []
        self._forward = 0.0

    def on_fit_start(self, trainer, pl_module) -> None:
        if pl_module.remote_features.remote is None and pl_module.target.decoder_layers:
            pl_module.target.register_forward_pre_hook(self._before)
            pl_module.target.register_forward_hook(self._after)

    def _before(self, module, inputs) -> None:
        self._began = time.perf_counter()

    def _after(self, module, inputs, output) -> None:
        self._forward += time.perf_counter() - self._began

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._start, self._forward = time.perf_counter(), 0.0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.steps.append(time.perf_counter() - self._start)
        self.forwards.append(self._forward)
        remote = pl_module.remote_features.remote
        self.waits.append(remote.last_wait_s if remote is not None else 0.0)


def shipped_run(workers: int, args: argparse.Namespace) -> StepClock:
    L.seed_everything(0, verbose=False)
    overrides = [
        f"--data.init_args.max_documents={args.documents}",
        "--data.init_args.val_fraction=0",
        "--data.init_args.setup_summary=false",
        f"--model.init_args.remote.workers={workers}",
    ]
    model, data = build_from_config(["--config", str(QUICKSTART), *overrides])
    clock = StepClock()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=args.warmup + args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[clock],
    )
    trainer.fit(model, datamodule=data)
    return clock


def per_step(values: list[float], warmup: int) -> str:
    return f"{statistics.mean(values[warmup:]):.3f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--modelled", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per unit")
    parser.add_argument("--token-ms", type=float, default=1.0, help="a worker's cost per token (ms)")
    parser.add_argument("--train-ms", type=float, default=10.0, help="the trainer's cost per step (ms)")
    parser.add_argument("--hidden", type=int, default=256, help="float32 features per token returned")
    parser.add_argument("--units-per-worker", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8, help="timed steps of the shipped-target runs")
    parser.add_argument("--documents", type=int, default=64, help="documents of the shipped-target runs")
    parser.add_argument("--skip-shipped", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    t_target, t_train = args.tokens * args.token_ms / 1000, args.train_ms / 1000
    start_local_ray(max(args.workers))
    print(
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the "
        f"start; units of {args.tokens} tokens at {args.token_ms} ms per token (t_target {t_target:.3f} s), "
        f"t_train {t_train:.3f} s, prefetch 2 W units, {args.hidden} float32 features per token returned"
    )
    measured = {}
    for workers in args.workers:
        measured[workers] = measured_steps_per_s(workers, args)
        print(f"W = {workers}: {measured[workers][0]:.2f} steps/s", file=sys.stderr, flush=True)
    # What a unit cost its worker beyond t_target, where the workers (not the trainer) set the pace.
    overheads = [
        max(w / rate - t_target, 0.0) for w, (rate, _) in measured.items() if w / t_target < 1 / t_train
    ]
    overhead = statistics.median(overheads) if overheads else 0.0
    print(
        "\nPer-unit overhead beyond t_target, measured (median over the worker-bound runs): "
        f"{overhead * 1000:.1f} ms; the model uses it.\n"
    )
    print(
        "| workers | measured steps/s (Ray actors) | model steps/s | bound min(W / t_target, 1 / t_train) "
        "| measured / bound | wait per step (s) |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for workers in [*args.workers, *args.modelled]:
        model = modelled_steps_per_s(workers, t_target, t_train, overhead, steps=20 * workers)
        bound = min(workers / t_target, 1 / t_train)
        if workers in measured:
            rate, wait = measured[workers]
            cells = f"{rate:.2f} | {model:.2f} | {bound:.2f} | {rate / bound:.0%} | {wait:.3f}"
        else:
            cells = f"- | {model:.2f} | {bound:.2f} | - | -"
        print(f"| {workers} | {cells} |")
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end of part 1")
    if args.skip_shipped:
        return
    print(
        f"\nShipped target ({QUICKSTART.relative_to(ROOT)}, {args.documents} documents), {args.steps} timed "
        f"steps after {args.warmup}; seconds per step (means):\n"
    )
    print("| target | step | waiting for features | target forward inside the step |")
    print("|---|---:|---:|---:|")
    for workers in (0, 2):
        clock = shipped_run(workers, args)
        where = "co-located" if workers == 0 else f"{workers} Ray workers"
        forward = per_step(clock.forwards, args.warmup) if workers == 0 else "0 (on the workers)"
        print(
            f"| {where} | {per_step(clock.steps, args.warmup)} | {per_step(clock.waits, args.warmup)} | "
            f"{forward} |"
        )
        sys.stdout.flush()
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
