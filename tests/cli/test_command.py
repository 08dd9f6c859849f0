"""The ``lightning-drafts`` command itself: its help, and a console free of warnings our entry point causes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(*code_or_args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, *code_or_args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )


def test_help_lists_every_subcommand_without_loading_torch():
    probe = (
        "import sys\n"
        "from lightning_drafts.cli.main import main\n"
        "main(['--help'])\n"
        "assert 'torch' not in sys.modules and 'lightning' not in sys.modules, 'help imported torch'\n"
    )
    result = run("-c", probe)
    assert result.returncode == 0, result.stderr
    for subcommand in ("fit", "validate", "export", "evaluate"):
        assert f"  {subcommand} " in result.stdout, subcommand


def test_an_unknown_subcommand_is_named():
    result = run("-m", "lightning_drafts", "fti")
    assert result.returncode != 0 and "unknown subcommand 'fti'" in result.stderr


def test_the_entry_point_lets_lightningcli_read_the_command_line():
    config = ROOT / "configs" / "quickstart" / "eagle3.yaml"
    result = run("-m", "lightning_drafts", "fit", f"--config={config}", "--print_config")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "class_path: lightning_drafts.Eagle3Module" in result.stdout
    # Passing sys.argv[1:] as `args` made LightningCLI warn that it is meant to run from Python.
    assert "args parameter is intended to run from within Python" not in result.stderr
