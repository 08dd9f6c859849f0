"""The mutation gate's catalog stays plantable: every original line is found exactly once in its file, and
every catching test it names exists (the gate itself, ``python tools/mutants.py``, runs them)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.mutants.catalog import MUTANTS, Mutant, catalog_problems

ROOT = Path(__file__).resolve().parents[2]


def test_every_mutant_can_be_planted_as_written():
    assert len(MUTANTS) >= 24
    assert catalog_problems(ROOT) == []


def test_a_rotten_entry_is_reported():
    moved = Mutant("moved", "lightning_drafts/core/acceptance.py", "no such line", "x", ("tests/x.py",), "")
    twice = Mutant("twice", "lightning_drafts/core/acceptance.py", "return hits, chain_valid", "pass", (), "")
    itself = Mutant(
        "itself",
        "lightning_drafts/core/acceptance.py",
        "return 1.0 + ratio.sum()",
        "pass",
        ("tests/mutants/test_catalog.py",),
        "",
    )
    problems = catalog_problems(ROOT, (moved, twice, moved, itself))
    assert any("itself: the catalog's own tests cannot" in p for p in problems)
    assert any("moved: the original line is found 0 times" in p for p in problems)
    assert any("twice: names no catching test" in p for p in problems)
    assert any("moved: the name is used twice" in p for p in problems)


def test_every_catching_test_exists():
    for mutant in MUTANTS:
        for node in mutant.tests:
            path, _, name = node.partition("::")
            assert (ROOT / path).is_file(), f"{mutant.name}: {path} does not exist"
            if name:
                function = re.sub(r"\[.*\]$", "", name)
                assert re.search(rf"^def {re.escape(function)}\(", (ROOT / path).read_text(), re.M), (
                    f"{mutant.name}: {path} has no test {function}"
                )
