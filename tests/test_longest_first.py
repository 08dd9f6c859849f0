"""The modules ``tests/conftest.py`` starts first exist: a renamed one would silently fall back to its
collection order and leave a worker running it alone at the end of the run."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import LONGEST_FIRST

ROOT = Path(__file__).resolve().parents[1]


def test_every_module_started_first_exists_once():
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
    missing = [module for module in LONGEST_FIRST if not (ROOT / module).is_file()]
    assert missing == [], missing
