"""A pytest that starts in a fraction of a second: one process imports the third-party libraries once
(torch, transformers, Lightning, pytest...), then forks a child per request that runs ``pytest.main`` from
a given directory, so each run imports only that directory's own code.

Importing those libraries is most of a short pytest run's CPU (about 6 of 8 CPU seconds for a small test
file on a 2-core machine), and the mutation gate runs pytest once per mutant. A forked child starts with
the libraries already in memory; the repository's packages (``lightning_drafts``, ``tests``) are never
imported by this process, so every child imports them from its own directory, mutant included.

Forking is safe here because this process runs no torch operation: no OpenMP or intra-op thread pool
exists yet to be copied half-initialised into the child.

    runner = PreloadedPytest(env)           # starts the server process
    rc, output = runner.run(directory, ["-x", "tests/test_a.py"], timeout_s=900)
    runner.close()
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Imported once by the server, before any fork; none of them is the repository's own code.
PRELOADED = (
    "torch",
    "transformers",
    "lightning",
    "lightning.pytorch",
    "pytest",
    "safetensors.torch",
    "datasets",
    "tensorboard.backend.event_processing.event_accumulator",
    "yaml",
    "jsonargparse",
)


class PreloadedPytest:
    """A server process that holds the imports; :meth:`run` asks it for one forked pytest run."""

    def __init__(self, env: dict[str, str]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, __file__],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=tempfile.gettempdir(),
        )
        ready = self.process.stdout.readline()
        if ready.strip() != "ready":
            raise RuntimeError(f"the preloaded pytest server did not start (it said {ready!r})")

    def run(self, directory: Path, args: list[str], timeout_s: float) -> tuple[int, str]:
        """``pytest.main(args)`` run from ``directory`` in a child forked off the server: its exit code
        (-1 when killed at ``timeout_s``) and its output."""
        with tempfile.NamedTemporaryFile("r", suffix=".log") as log:
            request = {"directory": str(directory), "args": args, "log": log.name, "timeout_s": timeout_s}
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            reply = self.process.stdout.readline()
            if not reply:
                raise RuntimeError("the preloaded pytest server exited")
            return int(json.loads(reply)["rc"]), log.read()

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


def _child(directory: str, args: list[str], log: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_TRUNC)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.chdir(directory)
    # The directory's own packages first, as ``python -m pytest`` run there would see them.
    sys.path.insert(0, directory)
    import pytest

    try:
        rc = pytest.main(args)
    except BaseException:  # a crash of pytest itself is an exit the caller must see, not a hang
        rc = 3
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(rc))


def _wait(pid: int, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return -1
        time.sleep(0.05)


def serve() -> None:
    import importlib

    for name in PRELOADED:
        importlib.import_module(name)
    leaked = sorted(name for name in sys.modules if name.split(".")[0] in {"lightning_drafts", "tests"})
    if leaked:
        raise SystemExit(f"the preloaded libraries imported the repository's own code: {leaked}")
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            # Its own process group, so a hang is killed with whatever it started.
            os.setpgid(0, 0)
            _child(request["directory"], request["args"], request["log"])
        rc = _wait(pid, request["timeout_s"])
        print(json.dumps({"rc": rc}), flush=True)


if __name__ == "__main__":
    serve()
