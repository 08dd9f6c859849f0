"""Disaggregated training checks, run as one process that starts Ray once (tests/training/test_remote_target.py).

``python remote_target_checks.py CONFIG...``: for each quickstart config, a few packed steps with the
target on 2 Ray workers give the co-located run's per-step losses and final draft digest, bit for bit.
Then, with the first config: workers SIGKILLed before and after they reply under a cap on bytes in
flight, and a late unit sent again whose first result arrives as a delayed duplicate, each ending with
the uninterrupted run's draft; a unit that always fails stops the run naming its documents; a worker of
another target is refused naming the field. Each check prints ``OK <name>``; any failure exits non-zero.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import ray
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_drafts.cli.fit import build_from_config
from lightning_drafts.core.digest import state_digest
from lightning_drafts.training.target_worker import TargetWorker

STEPS = 4
VALIDATED = "configs/quickstart/dflash.yaml"
DATA = [
    "--data.init_args.max_documents=24",
    "--data.init_args.max_tokens=96",
    "--data.init_args.batch_size=2",
    "--data.init_args.val_fraction=0",
    "--data.init_args.setup_summary=false",
]
START = time.monotonic()
MARKS = Path(tempfile.mkdtemp(prefix="remote-target-marks-"))


class Losses(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer, pl_module) -> None:
        # The run's RemoteTarget (the module lets go of it at teardown).
        self.remote = pl_module.remote_target


def build(config: str, *overrides: str):
    L.seed_everything(0, verbose=False)
    # One family validates too (a quarter of the documents held out).
    held_out = ["--data.init_args.val_fraction=0.25"] if config == VALIDATED else []
    return build_from_config(["--config", config, *DATA, *held_out, *overrides])


def fit(
    config: str, *overrides: str, remote_options: dict | None = None, callbacks=(), resume: str | None = None
):
    """Train to step ``STEPS``: co-located, or with ``remote_options`` on a RemoteTarget built from them;
    from the checkpoint ``resume`` if given. Returns (losses of the steps run, draft digest, the
    RemoteTarget or None, the trainer's logged metrics)."""
    model, data = build(config, *overrides)
    remote = None
    if remote_options is not None:
        remote = model.build_remote_target(**remote_options)
        model.use_remote_target(remote)
    losses = Losses()
    callbacks = [losses, *callbacks]
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        # Validation (of the configs that hold validation documents) every 2 steps, through the workers too.
        val_check_interval=2,
        limit_val_batches=2,
        callbacks=callbacks,
    )
    trainer.fit(model, datamodule=data, ckpt_path=resume)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    return losses.losses, state_digest(model.draft_state_dict()), remote or losses.remote, metrics


def same(name: str, reference, run) -> None:
    (losses_a, digest_a), (losses_b, digest_b) = reference[:2], run[:2]
    if losses_a != losses_b or digest_a != digest_b:
        raise AssertionError(
            f"{name}: losses {losses_b} vs co-located {losses_a}; digest {digest_b} vs {digest_a}"
        )


def check_exact(configs: list[str], checkpoints: Path) -> dict:
    """Also saves the first config's remote run at step 2 into ``checkpoints`` (for check_resume)."""
    references = {}
    for config in configs:
        reference = references[config] = fit(config)
        assert len(reference[0]) == STEPS and any(loss > 0 for loss in reference[0]), reference[0]
        saver = ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=2, save_top_k=-1, filename="{step}")
        run = fit(
            config,
            "--model.init_args.target_workers=2",
            callbacks=[saver] if config == configs[0] else [],
        )
        same(config, reference, run)
        if config == VALIDATED:
            assert "val/loss" in reference[3] and run[3]["val/loss"] == reference[3]["val/loss"], (
                run[3],
                reference[3],
            )
            runs = sorted({u.epoch for u in run[2].ledger.consumed if u.split == "val"})
            assert runs == [1, 2], runs
            print(
                f"OK validation through the workers: val/loss {run[3]['val/loss']} in runs {runs}", flush=True
            )
        # What TensorBoard gets: the trainer's wait for features and the units in flight, per step.
        assert "target/wait_s" in run[3] and "target/units_in_flight" in run[3], sorted(run[3])
        print(f"[{time.monotonic() - START:.0f} s] OK exact {config} losses={reference[0]}", flush=True)
    return references


def check_resume(config: str, reference, checkpoints: Path) -> None:
    """A trainer that crashed after its step-2 checkpoint (its later steps thrown away), resumed from it,
    asks the workers for the units after step 2 only and ends with the uninterrupted run's draft."""
    losses, digest, remote, _ = fit(
        config, remote_options={"workers": 2}, resume=str(checkpoints / "step=2.ckpt")
    )
    if losses != reference[0][2:] or digest != reference[1]:
        raise AssertionError(
            f"resumed: losses {losses} vs {reference[0][2:]}; digest {digest} vs {reference[1]}"
        )
    consumed = sorted(remote.ledger.consumed)
    assert [u.step for u in consumed] == list(range(2, STEPS)), consumed
    print(f"[{time.monotonic() - START:.0f} s] OK resumed from step 2: units {[str(u) for u in consumed]}")


def marked_once(name: str) -> bool:
    """True the first time ``name`` is asked for in this script (across worker restarts)."""
    mark = MARKS / name
    if mark.exists():
        return False
    mark.touch()
    return True


class DiesBeforeReplying(TargetWorker):
    """SIGKILLs itself while computing step 1's unit, the first time."""

    def features(self, unit, batch):
        if unit.split == "train" and unit.step == 1 and marked_once("before-reply"):
            os.kill(os.getpid(), signal.SIGKILL)
        return super().features(unit, batch)


class LateOnce(TargetWorker):
    """Answers step 2's unit 1.5 s late, the first time."""

    def features(self, unit, batch):
        if unit.split == "train" and unit.step == 2 and marked_once("late"):
            time.sleep(1.5)
        return super().features(unit, batch)


class AlwaysFails(TargetWorker):
    """Fails every attempt of step 2's unit (a target that cannot run it)."""

    def features(self, unit, batch):
        if unit.split == "train" and unit.step == 2:
            raise RuntimeError("this target cannot run these rows")
        return super().features(unit, batch)


class KillWorkersAfterStep(L.Callback):
    """SIGKILLs every worker once step ``step`` ended: results already sent are in the object store,
    the prefetched units still being computed die with their workers."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_start(self, trainer, pl_module) -> None:
        self.pids = pl_module.remote_target.worker_pids()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == self.step:
            for pid in self.pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass  # it killed itself already


class PauseAfterStep(L.Callback):
    """Sleeps once step ``step`` ended, long enough for a late first attempt to finish meanwhile."""

    def __init__(self, step: int, seconds: float) -> None:
        self.step, self.seconds = step, seconds

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == self.step:
            time.sleep(self.seconds)


def check_faults(config: str, reference) -> None:
    model, _ = build(config)
    request = model.feature_request()
    unit_bytes = 96 * 2 * (len(request.layer_ids) + 1) * model.target.text_config.hidden_size * 4
    cap = int(2.5 * unit_bytes)
    one = {"workers": 2}

    # Every worker SIGKILLed once step 0 ended (the results of the units after it already sent or not:
    # both happen), then the worker computing step 1 SIGKILLs itself before replying; under a byte cap
    # of 2.5 units with prefetch 8.
    run = fit(
        config,
        remote_options={**one, "worker_class": DiesBeforeReplying, "prefetch": 8, "max_bytes_in_flight": cap},
        callbacks=[KillWorkersAfterStep(0)],
    )
    same("killed before and after replying", reference, run)
    ledger = run[2].ledger
    assert run[2].retries >= 1, run[2].retries
    assert 2 <= ledger.peak_units <= 3 and ledger.peak_bytes <= cap, (
        ledger.peak_units,
        ledger.peak_bytes,
        cap,
    )
    print(
        f"[{time.monotonic() - START:.0f} s] OK killed before and after replying (retries={run[2].retries})"
    )
    print(
        f"OK bytes in flight peaked at {ledger.peak_bytes} <= cap {cap} ({ledger.peak_units} units)",
        flush=True,
    )

    run = fit(
        config,
        remote_options={**one, "worker_class": LateOnce, "unit_timeout_s": 0.3},
        callbacks=[PauseAfterStep(2, 2.0)],
    )
    same("delayed duplicate", reference, run)
    dropped = dict(run[2].ledger.dropped)
    assert dropped.get("duplicate", 0) >= 1 and run[2].retries >= 1, (dropped, run[2].retries)
    print(f"[{time.monotonic() - START:.0f} s] OK delayed duplicate dropped ({dropped})", flush=True)

    try:
        fit(config, remote_options={**one, "worker_class": AlwaysFails})
    except RuntimeError as error:
        message = str(error)
        assert "train unit (epoch 0, step 2, rank 0, micro-batch 0) failed 3 times" in message, message
        assert "its documents are train documents [" in message, message
        print(
            f"[{time.monotonic() - START:.0f} s] OK always-failing unit stops the run: {message[:200]}",
            flush=True,
        )
    else:
        raise AssertionError("a unit that always fails did not stop the run")

    model, _ = build(config)
    remote = model.build_remote_target(workers=1, worker_args={"dtype": "bfloat16"})
    try:
        model.use_remote_target(remote)
    except ValueError as error:
        assert "target worker 0 serves another target: dtype is 'bfloat16' there but 'float32'" in str(
            error
        ), error
        print(f"[{time.monotonic() - START:.0f} s] OK mismatched worker refused: {error}", flush=True)
    else:
        raise AssertionError("a worker of another target was accepted")


def main() -> None:
    torch.set_num_threads(1)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    configs = sys.argv[1:]
    checkpoints = Path(tempfile.mkdtemp(prefix="remote-target-checkpoints-"))
    references = check_exact(configs, checkpoints)
    check_resume(configs[0], references[configs[0]], checkpoints)
    check_faults(configs[0], references[configs[0]])
    ray.shutdown()


if __name__ == "__main__":
    main()
