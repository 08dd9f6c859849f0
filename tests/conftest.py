"""Shared fixtures: offline hub, two threads (``OMP_NUM_THREADS`` when set), one tiny target config per supported target kind, the family
under test (registered when it is not a shipped one) and one thread for decoding."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lightning_drafts.serving.family import DraftFamily
from tests.families.family_case import registered
from tests.support.builders import TINY_TARGETS
from tests.support.tiny_gguf import write_tiny_gguf

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Two threads on the 2-core machines CI runs on, shared among pytest-xdist's workers (one each when two run:
# a second thread per worker would only spin against the other worker); OMP_NUM_THREADS, when set, chooses
# another count, so the suite's tolerances can be run under 1 or 2 threads (a reduction's order changes with
# the thread count).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", str(max(1, 2 // _WORKERS)))))
# The shipped Qwen3 and DeepSeek-V3 targets' decoding makes subnormal floats (attention weights of about
# 1e-40), which x86 CPUs compute through a microcode path up to 80x slower; flushed to zero they change no
# token (the same greedy decodes) and the suite's comparisons hold within one process either way.
torch.set_flush_denormal(True)


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> tuple[Path, Path]:
    """``(tiny.gguf, its model as a Hugging Face folder)``: a tied tiny Llama written once per session
    (:mod:`tests.support.tiny_gguf`); tests that change the file copy it first."""
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf"))


@pytest.fixture(params=sorted(TINY_TARGETS))
def target_config(request) -> dict:
    return dict(TINY_TARGETS[request.param])


@pytest.fixture
def family(request) -> Iterator[DraftFamily]:
    """The family a test is parametrised with (``indirect``). One the library does not ship is registered
    for the test's duration through the seam every family plugs in through, and unregistered after."""
    with registered(request.param) as family:
        yield family


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Decoding runs hundreds of tiny forwards; a second thread only adds synchronisation to each."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- longest first: the modules that take longest start first, so the workers finish together ------------
# pytest-xdist (``--dist loadscope``) hands an idle worker the next module in collection order; a long module
# collected last would leave one worker running it alone while the other idles. These are the suite's
# longest modules, longest first (their seconds under two workers on the 2-core CI VM, from the durations
# ``.ci/run`` prints); every other module keeps its collection order after them.
LONGEST_FIRST = (
    "tests/serving/test_vllm.py",  # 250 s
    "tests/training/test_remote_target.py",  # 175 s
    "tests/distributed/test_preemption.py",  # 160 s
    "tests/distributed/test_distributed.py",  # 125 s
    "tests/workflows/test_real_model_pipeline.py",  # 90 s
    "tests/shipped/test_shipped_targets.py",  # 80 s
    "tests/gguf/test_real_configs.py",  # 60 s
    "tests/workflows/test_regenerate.py",  # 50 s
    "tests/families/test_context_memory.py",  # 45 s
    "tests/cli/test_command.py",  # 45 s
    "tests/data/test_datamodule.py",  # 45 s
    "tests/families/test_conformance.py",  # 40 s
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {module: index for index, module in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


# --- no skipped test: a skip hides a check that did not run, so any skip fails the run ---------------------
_SKIPPED: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        _SKIPPED.append(report.nodeid)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.skipped:
        _SKIPPED.append(report.nodeid or "collection")


# --- no run written into the checkout: the configs' relative run directories belong to the user -----------
# A test that runs a shipped config from the repository's directory would add runs/<name>/version_N there,
# and the README's runs/eagle3/version_0 would then not be the user's first run. Checked by the controller
# only (pytest-xdist's workers start after it and end before it).
_ROOT = Path(__file__).resolve().parents[1]
_RUN_DIRS = ("runs", "lightning_logs", "exports")
_RUNS_BEFORE: set[Path] = set()
_NEW_RUNS: list[str] = []


def _runs_in_checkout() -> set[Path]:
    return {path for name in _RUN_DIRS for pattern in ("*", "*/*") for path in (_ROOT / name).glob(pattern)}


def pytest_sessionstart(session: pytest.Session) -> None:
    if "PYTEST_XDIST_WORKER" not in os.environ:
        _RUNS_BEFORE.update(_runs_in_checkout())


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if "PYTEST_XDIST_WORKER" not in os.environ:
        _NEW_RUNS.extend(sorted(str(p.relative_to(_ROOT)) for p in _runs_in_checkout() - _RUNS_BEFORE))
    if (_SKIPPED or _NEW_RUNS) and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter) -> None:
    if _SKIPPED:
        terminalreporter.write_line(
            f"FAILED: {len(_SKIPPED)} skipped (this suite allows no skip; make each run or fail): "
            + ", ".join(_SKIPPED),
            red=True,
        )
    if _NEW_RUNS:
        terminalreporter.write_line(
            f"FAILED: the tests wrote {len(_NEW_RUNS)} run paths into the checkout (write runs under tmp_path, "
            "or chdir there): " + ", ".join(_NEW_RUNS),
            red=True,
        )
