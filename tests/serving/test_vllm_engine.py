"""The project side of the vLLM engine, without vLLM: how its python is found, what a failed run says, and
which exports it refuses before starting anything (the served behaviour is tests/serving/test_vllm.py's)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from lightning_drafts.eagle3.layout import DENSE_ARCHITECTURE, MLA_ARCHITECTURE
from lightning_drafts.registry import EAGLE3
from lightning_drafts.serving import vllm_engine
from lightning_drafts.serving.vllm_engine import (
    VLLM_PYTHON_ENV,
    VLLMRequest,
    VLLMRunError,
    VLLMSession,
    VLLMUnavailableError,
    find_vllm_python,
    run_vllm,
)


def test_a_missing_vllm_python_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv(VLLM_PYTHON_ENV, str(tmp_path / "nowhere" / "python"))
    with pytest.raises(
        VLLMUnavailableError, match=f"{VLLM_PYTHON_ENV}=.*nowhere/python is not an executable"
    ):
        find_vllm_python()


def test_without_an_environment_the_error_says_how_to_build_one(monkeypatch, tmp_path):
    monkeypatch.delenv(VLLM_PYTHON_ENV, raising=False)
    monkeypatch.setattr(vllm_engine, "REPOSITORY", tmp_path / "repo")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(VLLMUnavailableError, match=r"no vLLM environment.*\.ci/vllm-env"):
        find_vllm_python()
    (tmp_path / ".venv-vllm" / "bin").mkdir(parents=True)  # a build that stopped before its marker
    with pytest.raises(VLLMUnavailableError, match="was not finished"):
        find_vllm_python()


def test_a_failed_run_reports_its_command_and_log():
    # The project's own python has no vLLM: the runner starts, fails on its import, and says so.
    request = VLLMRequest(target="t", prompts=[[1, 2]], max_new_tokens=2, draft="d", method="eagle3")
    with pytest.raises(VLLMRunError) as failure:
        run_vllm(request, python=sys.executable)
    message = str(failure.value)
    assert "vllm_runner.py" in message and sys.executable in message
    assert "No module named 'vllm'" in message
    assert '"method": "eagle3"' in message


def test_a_session_whose_engine_cannot_start_reports_its_command_and_log():
    # As above: the runner's serve mode fails on its vLLM import before answering "ready".
    with pytest.raises(VLLMRunError) as failure:
        VLLMSession("t", python=sys.executable)
    message = str(failure.value)
    assert "the engine exited (1) without answering" in message
    assert "--serve" in message and "No module named 'vllm'" in message


def test_an_architecture_vllm_does_not_load_is_refused_by_name():
    assert EAGLE3.vllm_method(DENSE_ARCHITECTURE) == EAGLE3.vllm_method(MLA_ARCHITECTURE) == "eagle3"
    with pytest.raises(ValueError, match="vLLM loads no EAGLE-3 draft of architecture 'SomeOtherDraft'"):
        EAGLE3.vllm_method("SomeOtherDraft")


def test_the_runner_imports_only_vllm_tqdm_and_the_standard_library():
    # It runs in vLLM's environment, where the project is not installed.
    tree = ast.parse(Path(vllm_engine.RUNNER).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    roots = {name.split(".")[0] for name in imported}
    assert roots <= {"vllm", "tqdm", *sys.stdlib_module_names}, roots
