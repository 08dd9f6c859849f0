"""Every page a comment or docstring cites exists, and so does the heading it names.

Code cites the documentation as a repository path with an optional MkDocs anchor, e.g.
``docs/concepts/eagle3.md#training-time-test``. This test finds every such citation in the Python files
of the library, the data modules, the callbacks, the benchmarks, the tools and the tests, and checks the
page exists and one of its headings has that anchor. Citations of design notes the repository does not
ship (a section sign with a number, "ARCHITECTURE section 6", a bare ``eagle3.md``) are refused.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# lightning_drafts/datamodules and lightning_drafts/callbacks may be links to the top-level folders of the
# same name in a development checkout: read those folders once, under their own names.
SOURCE_DIRS = ("lightning_drafts", "datamodules", "callbacks", "benchmarks", "tools", "tests")
LINKED = {ROOT / "lightning_drafts" / "datamodules", ROOT / "lightning_drafts" / "callbacks"}
CITATION = re.compile(r"(?<![\w/.-])(docs/[\w/.-]+?\.md)(?:#([\w-]+))?")
# A design-note citation the repository cannot resolve: "eagle3.md \u00a75.2", "\u00a76.1", "ARCHITECTURE section 6",
# or a bare design-note file name (not a path, not a quoted file name the code opens).
STALE = re.compile(
    "\u00a7|ARCHITECTURE(?:\\.md)? (?:section|\u00a7)|(?<![\\w/.\"'-])(?:eagle3|dflash|dspark|ARCHITECTURE)\\.md\\b"
)
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$")
EXPLICIT_ID = re.compile(r"\{[^}]*#([\w-]+)[^}]*\}\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")


def slug(heading: str) -> str:
    """MkDocs' (Python-Markdown toc) anchor of a heading: ASCII, punctuation removed, lowercase, dashes."""
    text = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    found, in_fence = set(), False
    for line in page.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        heading = None if in_fence else HEADING.match(line)
        if heading:
            text = heading.group(1)
            explicit = EXPLICIT_ID.search(text)
            found.add(explicit.group(1) if explicit else slug(text))
    return found


def source_files() -> list[Path]:
    files = []
    for folder in SOURCE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            # This file names missing pages and old citation forms on purpose, as test data.
            if path != Path(__file__).resolve() and not any(path.is_relative_to(linked) for linked in LINKED):
                files.append(path)
    return files


def citations() -> list[tuple[str, str, str | None]]:
    """``(file:line, page, anchor or None)`` for every documentation citation in the source files."""
    found = []
    for path in source_files():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for match in CITATION.finditer(line):
                found.append((f"{path.relative_to(ROOT)}:{number}", match.group(1), match.group(2)))
    return found


def unresolved(cited: list[tuple[str, str, str | None]]) -> list[str]:
    problems, cache = [], {}
    for where, page, anchor in cited:
        path = ROOT / page
        if not path.is_file():
            problems.append(f"{where}: {page} does not exist")
            continue
        if anchor is not None:
            cache.setdefault(page, anchors(path))
            if anchor not in cache[page]:
                problems.append(f"{where}: {page} has no heading with anchor #{anchor}")
    return problems


def test_slug_follows_the_mkdocs_toc_rule_on_hand_written_headings():
    assert slug("Training-time test") == "training-time-test"
    assert slug("MLA attention and RoPE") == "mla-attention-and-rope"
    assert (
        slug("`accept_len`: the training-time estimate (tau_sim)")
        == "accept_len-the-training-time-estimate-tau_sim"
    )
    assert slug("The data module: `PackedChatDataModule`") == "the-data-module-packedchatdatamodule"
    assert slug("Résumé, step by step") == "resume-step-by-step"


def test_anchors_read_headings_outside_code_fences_and_explicit_ids(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n```bash\n# not a heading\n```\n\n## Block acceptance\n\n### Custom {#chosen-id}\n"
    )
    assert anchors(page) == {"title", "block-acceptance", "chosen-id"}


def test_every_cited_page_and_heading_exists():
    cited = citations()
    # The library cites its concept pages dozens of times; a broken pattern would find none and pass.
    assert len(cited) >= 50, f"found only {len(cited)} citations of docs/*.md pages; is CITATION still right?"
    assert {page for _, page, _ in cited} >= {
        "docs/concepts/eagle3.md",
        "docs/concepts/dflash.md",
        "docs/concepts/dspark.md",
    }
    problems = unresolved(cited)
    assert not problems, "citations that resolve to nothing:\n" + "\n".join(problems)


def test_a_citation_to_a_missing_heading_or_page_is_reported():
    cited = [
        ("a.py:1", "docs/concepts/eagle3.md", "training-time-test"),
        ("a.py:2", "docs/concepts/eagle3.md", "no-such-heading"),
        ("a.py:3", "docs/concepts/no-such-page.md", None),
    ]
    assert unresolved(cited) == [
        "a.py:2: docs/concepts/eagle3.md has no heading with anchor #no-such-heading",
        "a.py:3: docs/concepts/no-such-page.md does not exist",
    ]


def test_no_source_file_cites_design_notes_the_repository_does_not_ship():
    stale = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in source_files()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if STALE.search(line)
    ]
    assert not stale, "cite a docs/ page and heading instead:\n" + "\n".join(stale)


def test_the_stale_pattern_catches_each_old_citation_form():
    for old in (
        "(eagle3.md \u00a75.2)",
        "(see ARCHITECTURE section 6)",
        "DSpark (dspark.md):",
        "\u00a78 / \u00a717",
    ):
        assert STALE.search(old), old
    for fine in ("docs/concepts/dspark.md#loss", '/ "guides" / "dspark.md"', "DENSE_ARCHITECTURE, MLA"):
        assert not STALE.search(fine), fine
