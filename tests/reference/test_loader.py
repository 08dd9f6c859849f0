"""The reference loader: NeMo's draft files load without its package ``__init__`` files (which import vLLM
and SGLang), the wheel is found without the environment variable (``.ci/reference-env`` is run), and a
missing wheel fails with the reason and the command to run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from benchmarks.nemo_reference import ENV_VAR, ROOT, load, reference_root
from tests.support.hang_guard import HANG_GUARD_S

PROBE = """
import sys
from benchmarks.nemo_reference import load, reference_root
eagle = load("speculative.eagle.core")
package = sys.modules["nemo_automodel.components.speculative.eagle"]
print(reference_root())
print(eagle.__file__)
print(hasattr(package, "Eagle3TrainerModule"), any(m.split(".")[0] in ("vllm", "sglang") for m in sys.modules))
"""


def run_probe(env: dict[str, str], code: str = PROBE) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=HANG_GUARD_S
    )


def test_draft_files_load_without_package_init(reference):
    core = load("speculative.eagle.core")
    assert Path(core.__file__).is_relative_to(reference)
    package = sys.modules["nemo_automodel.components.speculative.eagle"]
    # Its __init__ would define these (and import vLLM / SGLang runners); it never ran.
    assert not hasattr(package, "Eagle3TrainerModule")
    assert not any(name.split(".")[0] in ("vllm", "sglang") for name in sys.modules)


def test_unset_variable_runs_reference_env(reference):
    env = {key: value for key, value in os.environ.items() if key != ENV_VAR}
    cache = Path(reference).parent
    if (cache / ".lightning-drafts-reference-ready").is_file():
        # The wheel .ci/reference-env unpacked (wherever its cache is): found ready, nothing downloaded.
        env["LIGHTNING_DRAFTS_REFERENCE_CACHE"] = str(cache)
    probe = run_probe(env)
    assert probe.returncode == 0, probe.stderr[-4000:]
    root, core, flags = probe.stdout.strip().splitlines()[-3:]
    assert Path(root) == Path(reference_root()) and Path(core).is_relative_to(root)
    assert flags == "False False", flags


def test_missing_wheel_fails_naming_the_command(tmp_path):
    env = {**os.environ, ENV_VAR: str(tmp_path)}
    probe = run_probe(env)
    assert probe.returncode != 0
    assert "ReferenceUnavailable" in probe.stderr and ".ci/reference-env" in probe.stderr, probe.stderr[
        -2000:
    ]
    script = subprocess.run(
        ["bash", str(ROOT / ".ci" / "reference-env")],
        capture_output=True,
        text=True,
        env=env,
        timeout=HANG_GUARD_S,
    )
    assert script.returncode == 1 and "FAILED" in script.stderr and str(tmp_path) in script.stderr
