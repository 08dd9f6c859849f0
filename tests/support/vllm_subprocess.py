"""The vLLM environment for the tests, and scripts of ``tests/scripts`` run in it: vLLM pins its own torch
build, so it never runs in this project's environment, only as a subprocess that exchanges JSON files.

The vLLM python is ``$LIGHTNING_DRAFTS_VLLM_PYTHON``, else the ``.venv-vllm`` that ``.ci/vllm-env`` builds
in the repository (once; later calls find it ready). No vLLM environment fails the calling test with the
reason instead of skipping it: these tests are what says vLLM serves the exports. Serving itself goes
through the project's runner (``evaluate_export(..., engine="vllm")``); the scripts here check what the
runner does not (vLLM's model code reading an export without serving it).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.support.hang_guard import HANG_GUARD_S

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "scripts"


@functools.cache
def vllm_python() -> Path:
    """``$LIGHTNING_DRAFTS_VLLM_PYTHON``, checked, else ``.venv-vllm`` built by ``.ci/vllm-env``."""
    built = subprocess.run(
        ["bash", str(ROOT / ".ci" / "vllm-env")], capture_output=True, text=True, timeout=HANG_GUARD_S
    )
    if built.returncode != 0:
        pytest.fail(
            f".ci/vllm-env could not provide a vLLM environment:\n{built.stderr[-4000:]}", pytrace=False
        )
    return Path(built.stdout.strip().splitlines()[-1])


def run_vllm_script(script: str, request: Any, workdir: Path) -> Any:
    """``tests/scripts/<script> REQUEST RESULT`` under the vLLM python; the JSON result it writes."""
    request_path, result_path = workdir / f"{script}.request.json", workdir / f"{script}.result.json"
    request_path.write_text(json.dumps(request))
    # One thread: vLLM's CPU kernels spin, and under load one thread is far faster than two.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [str(vllm_python()), str(SCRIPTS / script), str(request_path), str(result_path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=workdir,
        timeout=HANG_GUARD_S,
    )
    assert run.returncode == 0, f"{script} failed under vLLM:\n{run.stdout[-4000:]}\n{run.stderr[-8000:]}"
    return json.loads(result_path.read_text())
