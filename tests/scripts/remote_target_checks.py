"""Disaggregated training checks, run as one process that starts Ray once (tests/training/test_remote_target.py).

``python remote_target_checks.py CONFIG...`` (the five quickstart configs). First, that the library
imports without Ray. For each config, a few packed steps with the target on 2 Ray workers give the
co-located run's per-step losses and final draft digest, bit for bit; the validated family (DFlash) also
gets the co-located `val/` metrics and served acceptance (the same greedy generations). Online, then
cached: epoch 0 from the workers written into a features directory equal to `lightning-drafts capture`'s,
epoch 1 from it, the run equal to one whose epoch 1 trained from the capture; a trainer process SIGKILLed
mid-step (``--crash-child``, on this Ray) resumes from its last and its previous checkpoint to the same
draft and directory. With the first config: a checkpoint resumed; workers SIGKILLed before, while and
after they reply under a cap on bytes in flight, and a late unit sent again whose first result arrives as
a delayed duplicate, each ending with the uninterrupted run's draft; a unit that always fails stops the
run naming its documents; a worker of another target is refused naming the field. Last, two gloo trainer
ranks, one worker each, train on exactly their own units. Each check prints ``OK <name>``; any failure
exits non-zero.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file

from lightning_drafts.callbacks import ServedAcceptanceCallback
from lightning_drafts.cli.fit import build_from_config
from lightning_drafts.core.digest import state_digest
from lightning_drafts.training.remote.remote_target import start_local_ray
from lightning_drafts.training.remote.target_worker import TargetWorker
from lightning_drafts.workflows.capture import capture_features
from tests.support.hang_guard import HANG_GUARD_S

STEPS = 4
# Steps of the 2-rank runs.
RANK_STEPS = 3
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
        self.remote = pl_module.remote_features.remote


def build(config: str, *overrides: str):
    L.seed_everything(0, verbose=False)
    # One family validates too (a quarter of the documents held out).
    held_out = ["--data.init_args.val_fraction=0.25"] if config == VALIDATED else []
    return build_from_config(["--config", config, *DATA, *held_out, *overrides])


def fit(
    config: str,
    *overrides: str,
    remote_options: dict | None = None,
    callbacks=(),
    resume: str | None = None,
    epochs: int | None = None,
):
    """Train to step ``STEPS`` (or ``epochs`` epochs): co-located, or with ``remote_options`` on a
    RemoteTarget built from them; from the checkpoint ``resume`` if given.
    Returns (losses of the steps run, draft digest, the RemoteTarget or None, the trainer's logged
    metrics)."""
    model, data = build(config, *overrides)
    remote = None
    if remote_options is not None:
        remote = model.remote_features.build(**remote_options)
        model.remote_features.use(remote)
    losses = Losses()
    callbacks = [losses, *callbacks]
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=STEPS if epochs is None else -1,
        max_epochs=epochs,
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
        served_here, served_there = served(config), served(config)
        reference = references[config] = fit(config, callbacks=served_here)
        assert len(reference[0]) == STEPS and any(loss > 0 for loss in reference[0]), reference[0]
        saver = ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=2, save_top_k=-1, filename="{step}")
        run = fit(
            config,
            "--model.init_args.remote.workers=2",
            callbacks=[*([saver] if config == configs[0] else []), *served_there],
        )
        same(config, reference, run)
        if config == VALIDATED:
            assert "val/loss" in reference[3] and run[3]["val/loss"] == reference[3]["val/loss"], (
                run[3],
                reference[3],
            )
            runs = sorted({u.epoch for u in run[2].ledger.consumed if u.split == "val"})
            assert runs == [1, 2], runs
            # Served acceptance: the export decoded against the target (built in the trainer for it): the
            # same greedy generations (the target's own tokens) and acceptance as co-located.
            served_len = run[3]["val/served_accept_len"]
            assert served_len == reference[3]["val/served_accept_len"], (run[3], reference[3])
            here, there = served_here[0].report, served_there[0].report
            assert there.generations == here.generations and there.served == here.served, (there, here)
            assert there.generated_tokens > 0, there
            print(
                f"OK validation through the workers: val/loss {run[3]['val/loss']} in runs {runs}, "
                f"val/served_accept_len {served_len}",
                flush=True,
            )
        # What TensorBoard gets: the trainer's wait for features and the units in flight, per step.
        assert "target/wait_s" in run[3] and "target/units_in_flight" in run[3], sorted(run[3])
        print(f"[{time.monotonic() - START:.0f} s] OK exact {config} losses={reference[0]}", flush=True)
    return references


def served(config: str) -> list:
    """The validated family's runs serve their export at each validation too."""
    return [ServedAcceptanceCallback(num_prompts=2, max_new_tokens=6)] if config == VALIDATED else []


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


class DiesWhenSent:
    """A result that SIGKILLs its worker while Ray serializes it into the object store: the worker dies
    with its reply half sent, after the unit was computed."""

    def __init__(self, result) -> None:
        self.result = result

    def __reduce__(self):
        os.kill(os.getpid(), signal.SIGKILL)


class DiesBeforeReplying(TargetWorker):
    """SIGKILLs itself while computing step 1's unit, and while sending step 3's, the first time each."""

    def features(self, unit, batch):
        if unit.split == "train" and unit.step == 1 and marked_once("before-reply"):
            os.kill(os.getpid(), signal.SIGKILL)
        result = super().features(unit, batch)
        if unit.split == "train" and unit.step == 3 and marked_once("while-replying"):
            return DiesWhenSent(result)
        return result


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
        self.pids = pl_module.remote_features.remote.worker_pids()

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
    # both happen), then the worker computing step 1 SIGKILLs itself before replying and the one sending
    # step 3's result while sending it; under a byte cap of 2.5 units with prefetch 8.
    run = fit(
        config,
        remote_options={**one, "worker_class": DiesBeforeReplying, "prefetch": 8, "max_bytes_in_flight": cap},
        callbacks=[KillWorkersAfterStep(0)],
    )
    same("killed before, while and after replying", reference, run)
    ledger = run[2].ledger
    assert run[2].retries >= 2, run[2].retries
    assert not marked_once("while-replying"), "no worker died while sending its result"
    assert 2 <= ledger.peak_units <= 3 and ledger.peak_bytes <= cap, (
        ledger.peak_units,
        ledger.peak_bytes,
        cap,
    )
    print(
        f"[{time.monotonic() - START:.0f} s] OK killed before, while and after replying (retries={run[2].retries})"
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
    remote = model.remote_features.build(workers=1, worker_args={"dtype": "bfloat16"})
    try:
        model.remote_features.use(remote)
    except ValueError as error:
        assert "target worker 0 serves another target: dtype is 'bfloat16' there but 'float32'" in str(
            error
        ), error
        print(f"[{time.monotonic() - START:.0f} s] OK mismatched worker refused: {error}", flush=True)
    else:
        raise AssertionError("a worker of another target was accepted")


# Online, then cached: a few documents, so that an epoch is 3 steps and the run 2 epochs.
CACHED = ["--data.init_args.max_documents=8"]
EPOCHS = 2


def cache_options(directory: Path, *more: str) -> list[str]:
    return [
        *CACHED,
        "--model.init_args.remote.workers=2",
        f"--model.init_args.remote.cache_dir={directory}",
        *more,
    ]


def same_store(name: str, written: Path, captured: Path) -> None:
    """``written`` holds what ``captured`` (a `lightning-drafts capture`) holds: the manifest but its
    timing, the same shard files, every tensor equal; no received file is left."""
    a, b = (json.loads((d / "features.json").read_text()) for d in (written, captured))
    a.pop("capture_seconds"), b.pop("capture_seconds")
    if a != b:
        raise AssertionError(f"{name}: manifest {a} vs the capture's {b}")
    files = sorted(p.name for p in written.iterdir())
    assert files == sorted(p.name for p in captured.iterdir()), (files, list(captured.iterdir()))
    for path in captured.glob("*.safetensors"):
        mine, theirs = load_file(written / path.name), load_file(path)
        assert sorted(mine) == sorted(theirs), (sorted(mine), sorted(theirs))
        for key, tensor in theirs.items():
            if tensor.dtype != mine[key].dtype or not torch.equal(tensor, mine[key]):
                raise AssertionError(f"{name}: {path.name} {key} differs from the capture's")


class TrainFromAfterEpoch0(L.Callback):
    """A co-located run whose later epochs train from the features directory ``directory``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if trainer.current_epoch == 0:
            trainer.datamodule.use_features(str(self.directory))


class DieWhileTraining(L.Callback):
    """SIGKILLs the trainer during step ``step`` (its features received), right after the previous
    step's checkpoint."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def crash_child(config: str, address: str, checkpoints: str, cache: str) -> None:
    """The trainer that is killed: 2 workers on the parent's Ray, a checkpoint after every step."""
    torch.set_num_threads(1)
    saver = ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    fit(
        config,
        *cache_options(Path(cache), f"--model.init_args.remote.address={address}"),
        callbacks=[saver, DieWhileTraining(2)],
        epochs=EPOCHS,
    )
    raise AssertionError("the trainer was not killed")


def check_cache(config: str) -> None:
    """Online, then cached: epoch 0 from the workers, written into a features directory, epoch 1 from it
    without them. The directory equals `lightning-drafts capture`'s of the same documents; the run equals
    one whose epoch 0 ran co-located and whose epoch 1 trained from that capture (validation included). A trainer SIGKILLed mid
    step 2 (right after step 2's checkpoint), resumed from step 2 and from step 1, ends with the same
    draft and directory."""
    root = Path(tempfile.mkdtemp(prefix="remote-target-cache-"))
    run = fit(config, *cache_options(root / "cached"), epochs=EPOCHS)
    assert run[2] is None and len(run[0]) == 2 * 3, (run[2], run[0])
    model, data = build(config, *CACHED)
    capture_features(model, data, root / "captured")
    same_store("cached", root / "cached", root / "captured")

    reference = fit(config, *CACHED, epochs=EPOCHS, callbacks=[TrainFromAfterEpoch0(root / "captured")])
    same("cached epochs", reference, run)
    assert run[3]["val/loss"] == reference[3]["val/loss"], (run[3], reference[3])
    print(
        f"[{time.monotonic() - START:.0f} s] OK cached epochs equal the capture's: losses {run[0]}",
        flush=True,
    )

    import ray

    address = ray.get_runtime_context().gcs_address
    crashed = root / "crashed"
    child = subprocess.run(
        [sys.executable, __file__, "--crash-child", config, address, str(root / "ckpt"), str(crashed)],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert child.returncode == -signal.SIGKILL, child.stdout[-2000:] + child.stderr[-4000:]
    left = sorted(p.name for p in (crashed / "received").iterdir())
    assert left and not (crashed / "data_files-00000.safetensors").exists(), left
    for step in (2, 1):
        cache = root / f"resumed-{step}"
        shutil.copytree(crashed, cache)
        resumed = fit(
            config, *cache_options(cache), epochs=EPOCHS, resume=str(root / "ckpt" / f"step={step}.ckpt")
        )
        same(f"resumed from step {step}", (run[0][step:], run[1]), resumed)
        same_store(f"resumed from step {step}", cache, root / "captured")
    print(
        f"[{time.monotonic() - START:.0f} s] OK trainer killed mid step 2, resumed from steps 2 and 1: the "
        f"uninterrupted draft and directory (the crash left {len(left)} received units)",
        flush=True,
    )


class RankRecord(L.Callback):
    """Each rank of a 2-rank run writes its per-step losses, the units it trained on and its final draft's
    digest."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer, pl_module) -> None:
        remote = pl_module.remote_features.remote
        units = [] if remote is None else [vars(u) for u in sorted(remote.ledger.consumed)]
        record = {"losses": self.losses, "units": units, "digest": state_digest(pl_module.draft_state_dict())}
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def two_ranks(config: str, out: Path, *overrides: str) -> list[dict]:
    out.mkdir(parents=True)
    L.seed_everything(0, verbose=False)
    model, data = build_from_config(["--config", config, *DATA, *overrides])
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        max_steps=RANK_STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[RankRecord(out)],
    )
    trainer.fit(model, datamodule=data)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def check_two_ranks(config: str) -> None:
    """Two trainer ranks (DDP on gloo) whose ranks join this Ray (``remote.address``) with one worker
    each: every rank trains on exactly its own units (its rank, every step once) with the co-located
    rank's per-step losses and draft."""
    import ray

    out = Path(tempfile.mkdtemp(prefix="remote-target-ranks-"))
    address = ray.get_runtime_context().gcs_address
    reference = two_ranks(config, out / "co-located")
    remote = two_ranks(
        config,
        out / "remote",
        "--model.init_args.remote.workers=1",
        f"--model.init_args.remote.address={address}",
    )
    for rank in range(2):
        expected = [
            {"split": "train", "epoch": 0, "step": s, "rank": rank, "micro": 0} for s in range(RANK_STEPS)
        ]
        assert remote[rank]["units"] == expected, (rank, remote[rank]["units"])
        assert remote[rank]["losses"] == reference[rank]["losses"], (rank, remote, reference)
        assert remote[rank]["digest"] == reference[rank]["digest"], (rank, remote, reference)
    assert reference[0]["losses"] != reference[1]["losses"], reference
    print(
        f"[{time.monotonic() - START:.0f} s] OK two ranks each trained on their own units exactly", flush=True
    )


def main() -> None:
    if sys.argv[1] == "--crash-child":
        crash_child(*sys.argv[2:])
        return
    # Everything above is imported (the library, its fit, capture and callbacks), Ray not yet.
    assert "ray" not in sys.modules, "importing the library imported ray"
    print("OK the library imports without ray", flush=True)
    import ray

    torch.set_num_threads(1)
    start_local_ray(4)
    configs = sys.argv[1:]
    checkpoints = Path(tempfile.mkdtemp(prefix="remote-target-checkpoints-"))
    references = check_exact(configs, checkpoints)
    check_cache(VALIDATED)
    check_resume(configs[0], references[configs[0]], checkpoints)
    check_faults(configs[0], references[configs[0]])
    check_two_ranks(configs[2])
    ray.shutdown()


if __name__ == "__main__":
    main()
