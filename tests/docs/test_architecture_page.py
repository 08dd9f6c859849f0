"""The architecture page lists every source file: ``docs/architecture.md`` holds one ``<!-- modules: FOLDER -->``
directive per source folder, which ``docs/hooks.py`` renders as a table of the folder's files and the first
paragraph of each module docstring. A file in a folder the page does not name, or a file without a
docstring, is missing from the page, and these tests fail."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "architecture.md"
# lightning_drafts/datamodules and lightning_drafts/callbacks may be links to the top-level folders in a
# development checkout: the page names the top-level folders.
LINKED = {ROOT / "lightning_drafts" / "datamodules", ROOT / "lightning_drafts" / "callbacks"}
MODULES = re.compile(r"^<!-- modules: (\S+) -->$", re.MULTILINE)


def source_files() -> list[Path]:
    files = []
    for folder in ("lightning_drafts", "datamodules", "callbacks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if not any(path.is_relative_to(linked) for linked in LINKED):
                files.append(path)
    return files


def missing_from(page: str, hooks) -> list[str]:
    """The source files the rendered page does not list, as repository paths."""
    listed = set()
    for folder in MODULES.findall(page):
        for name in re.findall(r"^\| `([^`]+\.py)` \|", hooks.modules(folder), re.MULTILINE):
            listed.add(f"{folder}/{name}")
    return [str(p.relative_to(ROOT)) for p in source_files() if str(p.relative_to(ROOT)) not in listed]


def test_every_source_file_is_on_the_architecture_page(hooks):
    files = source_files()
    assert len(files) > 100, f"found only {len(files)} source files; is the walk still right?"
    missing = missing_from(PAGE.read_text(), hooks)
    assert not missing, "add a <!-- modules: FOLDER --> line to docs/architecture.md for:\n" + "\n".join(
        missing
    )


def test_a_folder_left_off_the_page_is_reported(hooks):
    page = PAGE.read_text().replace("<!-- modules: lightning_drafts/core -->\n", "")
    missing = missing_from(page, hooks)
    assert "lightning_drafts/core/batch.py" in missing
    assert all(path.startswith("lightning_drafts/core/") for path in missing), missing


def test_the_rendered_page_has_each_file_with_its_docstring_summary(hooks):
    rendered = hooks.on_page_markdown(PAGE.read_text(), None, None, None)
    assert "<!-- modules:" not in rendered
    # core/batch.py's docstring opens with this sentence (a hand-picked example, not read from the code).
    assert (
        "| `batch.py` | The batch contract: validate a (packed or padded) batch and derive its packing"
        in rendered
    )


def test_a_file_without_a_module_docstring_is_refused(hooks, tmp_path):
    (tmp_path / "bare.py").write_text("x = 1\n")
    # An absolute folder: ROOT / folder is the folder itself.
    with pytest.raises(ValueError, match="bare.py has no module docstring"):
        hooks.modules(str(tmp_path))


def test_the_architecture_page_has_no_wide_code_block():
    # A fenced block does not wrap: wider than the content column, the site cuts it off.
    text = re.sub(r"^<!--.*-->$", "", PAGE.read_text(), flags=re.MULTILINE)
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    wide = [line for block in blocks for line in block.splitlines() if len(line) > 90]
    assert not wide, wide
