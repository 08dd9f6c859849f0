"""The target matrix page shows what the matrix test runs: its table is the one built from the test's own
parametrisation (tests/support/target_matrix.py and the draft classes the test trains)."""

from __future__ import annotations

from pathlib import Path

from tests.support.target_matrix import matrix_table
from tests.training.test_target_matrix import family_cells

ROOT = Path(__file__).resolve().parents[2]


def test_the_target_matrix_page_holds_the_tested_matrix():
    names = list(dict.fromkeys(cell.values[0].__name__ for cell in family_cells()))
    table = matrix_table(names)
    page = (ROOT / "docs" / "reference" / "target-matrix.md").read_text()
    assert table in page, f"docs/reference/target-matrix.md must hold the matrix as tested:\n{table}"
    assert "reference/target-matrix.md" in (ROOT / "mkdocs.yml").read_text()
