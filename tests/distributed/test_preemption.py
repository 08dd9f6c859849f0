"""Preemption: a 2-process CPU fit (gloo DDP) stopped by SIGTERM or killed by SIGKILL at a chosen step,
resumed with `fit --ckpt_path last`, trains exactly as a fit that was never interrupted: the same loss at
every step on every rank and the same final weights, bit for bit (one thread per process, so every
reduction runs in the same order), logged into the same TensorBoard run. For EAGLE-3, and for the block
drafts (DFlash, DSpark), whose anchors and variable prefixes are random draws of every step."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_drafts.datamodules import PackedChatDataModule
from tests.support.hang_guard import HANG_GUARD_S
from tests.support.step_recorder import document_digest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "preempted_fit.py"
STEPS = 6
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def fit(
    out: Path, launch: str, devices: int, *extra: str, family: str = "eagle3"
) -> subprocess.CompletedProcess:
    run = subprocess.run(
        [sys.executable, str(SCRIPT), str(out), family, launch, str(devices), str(STEPS), "--", *extra],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    return run


def interrupted_fit(
    out: Path, devices: int, step: int, signum: int, *extra: str, family: str = "eagle3"
) -> tuple[int, str]:
    """A fit held at ``step`` and then signalled (SIGTERM / SIGINT: its launching process, as a scheduler
    or a terminal does) or killed (SIGKILL: every process); its exit status and output."""
    until = "kill" if signum == signal.SIGKILL else "signal"
    log = out / f"interrupted-{signum}.log"
    out.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as handle:
        process = subprocess.Popen(
            [
                sys.executable,
                str(SCRIPT),
                str(out),
                family,
                "cut",
                str(devices),
                str(STEPS),
                str(step),
                until,
                "--",
                *extra,
            ],
            cwd=ROOT,
            env=ENV,
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + HANG_GUARD_S
        while not (out / "held").exists():
            assert process.poll() is None, log.read_text()[-5000:]
            assert time.monotonic() < deadline, "the fit never reached the step it is held at"
            time.sleep(0.1)
        if signum == signal.SIGKILL:
            os.killpg(process.pid, signal.SIGKILL)
        else:
            os.kill(process.pid, signum)
        returncode = process.wait(timeout=HANG_GUARD_S)
    return returncode, log.read_text()


def steps(out: Path, launch: str, rank: int) -> list[dict]:
    path = out / f"steps-{launch}-rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_continues(
    reference: Path, out: Path, ranks: int, resumed_from: int, family: str = "eagle3"
) -> None:
    for rank in range(ranks):
        expected = steps(reference, "ref", rank)
        assert [r["step"] for r in expected] == list(range(1, STEPS + 1))
        cut, resumed = steps(out, "cut", rank), steps(out, "resume", rank)
        assert cut == expected[: len(cut)], f"rank {rank}: the interrupted run already differs"
        assert [r["step"] for r in resumed] == list(range(resumed_from + 1, STEPS + 1)), rank
        assert resumed == expected[resumed_from:], f"rank {rank}: the resumed run's steps differ"
    final = torch.load(out / "weights-resume.pt")
    uninterrupted = torch.load(reference / "weights-ref.pt")
    assert final.keys() == uninterrupted.keys() and final
    for name, tensor in uninterrupted.items():
        assert torch.equal(final[name], tensor), name
    # One TensorBoard run holds the whole curve: the resumed fit logged into version_0, not version_1.
    runs = out / "runs" / family
    assert sorted(p.name for p in runs.iterdir()) == ["version_0"]
    events = EventAccumulator(str(runs / "version_0"))
    events.Reload()
    assert {e.step for e in events.Scalars("train/loss")} >= set(range(STEPS))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted")
    fit(out, "ref", 2)
    return out


def test_sigterm_saves_the_step_and_the_resumed_fit_equals_an_uninterrupted_one(reference, tmp_path):
    returncode, log = interrupted_fit(tmp_path, 2, 3, signal.SIGTERM)
    assert returncode == 128 + signal.SIGTERM, log[-5000:]
    assert "received SIGTERM: saving step 3" in log
    saved = torch.load(
        tmp_path / "runs" / "eagle3" / "version_0" / "checkpoints" / "last.ckpt", weights_only=False
    )
    assert saved["global_step"] == 3 and saved["optimizer_states"][0]["state"]
    fit(tmp_path, "resume", 2, "--ckpt_path=last")
    assert_continues(reference, tmp_path, 2, resumed_from=3)


def test_sigkill_loses_only_the_steps_after_the_last_checkpoint(reference, tmp_path):
    # Held (and killed) at step 5: the last checkpoint is the one written after the validation at step 4.
    returncode, _ = interrupted_fit(tmp_path, 2, 5, signal.SIGKILL)
    assert returncode == -signal.SIGKILL
    fit(tmp_path, "resume", 2, "--ckpt_path=last")
    assert_continues(reference, tmp_path, 2, resumed_from=4)


@pytest.mark.parametrize(
    ("family", "signum", "held_at", "resumed_from"),
    # DFlash2 draws through DFlash's code (a subclass): its own three fits would add minutes, not a path.
    [("dflash", signal.SIGKILL, 5, 4), ("dspark", signal.SIGTERM, 3, 3)],
)
def test_a_block_draft_resumed_after_preemption_draws_what_the_uninterrupted_fit_drew(
    tmp_path, family, signum, held_at, resumed_from
):
    """Anchors (and DFlash's variable prefixes) are drawn every step; the resumed fit draws the same ones
    as a fit never interrupted, so its losses and final weights are that fit's, bit for bit. One process:
    a draw is a function of the seed, stage, step, rank and micro-batch (tests/training/test_step_draws.py
    shows each one changes it), so what a resume must restore is the step, on one rank as on two; the
    two-rank resume is the EAGLE-3 tests' above."""
    reference = tmp_path / "uninterrupted"
    fit(reference, "ref", 1, family=family)
    returncode, log = interrupted_fit(tmp_path / "cut", 1, held_at, signum, family=family)
    assert returncode == (-signum if signum == signal.SIGKILL else 128 + signum), log[-5000:]
    fit(tmp_path / "cut", "resume", 1, "--ckpt_path=last", family=family)
    assert_continues(reference, tmp_path / "cut", 1, resumed_from=resumed_from, family=family)


def train_documents(out: Path) -> Counter:
    """Digests of the training split's documents, read from the data module itself (not its loader)."""
    config = yaml.safe_load((out / "config-cut.yaml").read_text())["data"]["init_args"]
    data = PackedChatDataModule(**config)
    data.setup("fit")
    documents = data.train_documents
    return Counter(document_digest(*documents.tokens(i)) for i in range(len(documents)))


def documents_of_epoch(out: Path, launch: str, ranks: int, through_step: int | None = None) -> Counter:
    seen = Counter()
    for rank in range(ranks):
        for record in steps(out, launch, rank):
            if record["epoch"] == 0 and (through_step is None or record["step"] <= through_step):
                seen.update(record["documents"])
    return seen


# One epoch (about 12 steps of 2 ranks x 2 rows, 24 of 1 rank) stopped at step 3, then resumed to its end.
ONE_EPOCH = ("--trainer.max_steps=-1", "--trainer.max_epochs=1")


@pytest.mark.parametrize(("before", "after", "signum"), [(2, 1, signal.SIGTERM), (1, 2, signal.SIGINT)])
def test_a_checkpoint_resumes_on_another_world_size_using_every_document_of_the_epoch_once(
    tmp_path, before, after, signum
):
    returncode, log = interrupted_fit(tmp_path, before, 3, signum, *ONE_EPOCH)
    assert returncode == 128 + signum, log[-5000:]
    fit(tmp_path, "resume", after, "--ckpt_path=last", *ONE_EPOCH)
    expected = train_documents(tmp_path)
    assert sum(expected.values()) > 20
    seen = documents_of_epoch(tmp_path, "cut", before, through_step=3) + documents_of_epoch(
        tmp_path, "resume", after
    )
    assert seen == expected, f"missing {expected - seen}, repeated {seen - expected}"
    # The resumed run really started mid-epoch, at the step the checkpoint holds.
    assert steps(tmp_path, "resume", 0)[0]["step"] == 4
