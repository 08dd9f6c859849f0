"""The README is a product page: short, and it states current figures, not the history behind them."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_LINES = 200
# How a lab journal reads: a commit named as "the code at <sha>", a session, an hour, a promise of "yet".
JOURNAL = re.compile(
    r"the code at [0-9a-f]{7}|same sitting|slower hour|busier hour|(?:not|nothing) (?:\w+ )*yet|so far|"
    r"in an hour when",
    re.IGNORECASE,
)


def journal_phrases(text: str) -> list[str]:
    return [f"{n}: {line}" for n, line in enumerate(text.splitlines(), 1) if JOURNAL.search(line)]


def test_the_readme_has_at_most_200_lines():
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_LINES, f"README.md has {lines} lines; keep it to {MAX_LINES} and move detail to docs/"


def test_the_journal_finder_on_hand_written_lines():
    assert journal_phrases("The code at 84fcb4c, in the same sitting: 2.30x") == [
        "1: The code at 84fcb4c, in the same sitting: 2.30x"
    ]
    assert journal_phrases("Nothing has run on a GPU yet.\nThe best draft so far.") == [
        "1: Nothing has run on a GPU yet.",
        "2: The best draft so far.",
    ]
    assert journal_phrases("Served accept_len 2.06 (16 prompts x 64 tokens, 2-core CPU).") == []


def test_the_readme_states_figures_without_their_history():
    found = journal_phrases(README.read_text())
    assert not found, (
        "state the current figure, its command and machine; history goes to CHANGELOG.md:\n"
        + "\n".join(found)
    )
