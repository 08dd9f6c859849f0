"""Numbered lists render with the numbers they are written with.

MkDocs (Python-Markdown) numbers every ordered list from 1, whatever its first item says: a list that an
unindented paragraph interrupts restarts at 1 on the site, so items written "5." and "6." render as 1 and 2.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
ITEM = re.compile(r"^(\d+)\. ")


def restarted_lists(text: str) -> list[str]:
    """``line: text`` of each ordered list that begins with an item other than 1."""
    found, previous, block, in_fence = [], "blank", "text", False
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith(("```", "~~~")):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        item = ITEM.match(line)
        if item:
            starts_list = previous == "text" or (previous == "blank" and block != "list")
            if starts_list and item.group(1) != "1":
                found.append(f"{number}: {line}")
            previous = block = "list"
        elif not line.strip():
            previous = "blank"
        elif line.startswith((" ", "\t")) and block == "list":
            previous = "list"  # an item's continuation line
        else:
            previous = block = "text"
    return found


def test_the_restart_finder_on_hand_written_lists():
    assert restarted_lists("1. a\n2. b\n\n3. c, a loose item of the same list\n") == []
    assert restarted_lists("1. a\n   more of a\n2. b\n") == []
    assert restarted_lists("1. a\n2. b\n\nA paragraph.\n\n3. c\n") == ["6: 3. c"]
    assert restarted_lists("```\n5. inside a fence\n```\n") == []


def test_no_page_has_an_ordered_list_that_restarts_after_a_paragraph():
    found = [
        f"{page.relative_to(ROOT)}:{where}" for page in PAGES for where in restarted_lists(page.read_text())
    ]
    assert not found, "these render numbered from 1 on the site:\n" + "\n".join(found)
