"""``hooks``: docs/hooks.py (the code MkDocs runs to generate pages), loaded once per test module."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def hooks():
    """docs/hooks.py, loaded once: its rendered help texts and tables are cached for the module's tests."""
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    module.cli_help.cache_clear()
    module.modules.cache_clear()
