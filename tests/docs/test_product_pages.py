"""The README and the Results pages are product pages: they state current figures with their command and
machine, not the history behind them (that is CHANGELOG.md's), and the README stays short."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
RESULTS = sorted((ROOT / "docs" / "results").glob("*.md"))
MAX_LINES = 200
# How a lab journal reads: a commit named as "the code at <sha>", a session, an hour, a promise of "yet".
JOURNAL = re.compile(
    r"the code at [0-9a-f]{7}|same sitting|slower hour|busier hour|(?:not|nothing) (?:\w+ )*yet|so far|"
    r"in an hour when",
    re.IGNORECASE,
)
# When a figure was taken (a date, a clock time) or which commit it was taken on: history, not the figure.
WHEN = re.compile(
    r"\b20\d\d-\d\d-\d\d\b|\b\d\d:\d\d UTC\b|\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b"
)


def journal_phrases(text: str) -> list[str]:
    return [f"{n}: {line}" for n, line in enumerate(text.splitlines(), 1) if JOURNAL.search(line)]


def dated_lines(text: str) -> list[str]:
    return [f"{n}: {line}" for n, line in enumerate(text.splitlines(), 1) if WHEN.search(line)]


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


def test_the_date_finder_on_hand_written_lines():
    assert dated_lines(
        "Measured 2026-12-03 10:36 UTC.\nThe code at 84fcb4c.\n1,574 s; 2,183 slots; 0.331"
    ) == [
        "1: Measured 2026-12-03 10:36 UTC.",
        "2: The code at 84fcb4c.",
    ]


def test_results_pages_state_figures_without_dates_or_history():
    assert len(RESULTS) >= 10, [page.name for page in RESULTS]
    found = [
        f"{page.relative_to(ROOT)}:{where}"
        for page in [README, *RESULTS]
        for where in dict.fromkeys(journal_phrases(page.read_text()) + dated_lines(page.read_text()))
    ]
    assert not found, (
        "state the current figure, its command and machine; history goes to CHANGELOG.md:\n"
        + "\n".join(found)
    )
