"""The add-a-family guide lists what the probe family (``tests/families/probe/``, a family the library does not
ship) had to provide: every field its registry record sets, every kind of file in its folder, and places
that exist; a new record field, or a guide pointing at a moved file, fails here."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from lightning_drafts.serving.family import DraftFamily
from tests.families.probe import PROBE

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "guides" / "add-family.md"
PROBE_FOLDER = ROOT / "tests" / "families" / "probe"
# What each file of the probe's folder is, in the guide's words (written out here, not read from it).
PROBE_FILES = {
    "module.py": "module.py",
    "export.py": "write_export",  # the writer, with the validator and speculator a shipped family splits out
    "family.py": "family.py",
    "cases.py": "cases.py",
    "quickstart.yaml": "configs/quickstart/<family>.yaml",
}


def guide() -> str:
    return GUIDE.read_text()


def test_the_guide_names_every_field_of_a_family_record():
    text = guide()
    fields = [field.name for field in dataclasses.fields(DraftFamily)]
    assert len(fields) >= 9
    missing = [name for name in fields if f"{name}" not in text]
    assert not missing, f"{GUIDE} does not say what to give these DraftFamily fields: {missing}"
    # The probe's own record sets no field the guide leaves out.
    set_by_probe = [f.name for f in dataclasses.fields(PROBE) if getattr(PROBE, f.name) != f.default]
    assert set(set_by_probe) <= set(fields) and "validate" in set_by_probe


def test_the_guide_covers_every_file_of_the_probe_family():
    files = sorted(p.name for p in PROBE_FOLDER.iterdir() if p.is_file() and p.name != "__init__.py")
    assert files == sorted(PROBE_FILES), f"the probe folder holds {files}: say in PROBE_FILES what each is"
    text = guide()
    for name, words in PROBE_FILES.items():
        assert words in text, f"{GUIDE} does not name {words!r} (the probe's {name})"


def test_every_place_the_guide_names_exists():
    paths = set(
        re.findall(
            r"`((?:lightning_drafts|tests|tools|benchmarks|configs)/[\w/<>.-]+\.(?:py|yaml))`", guide()
        )
    )
    assert len(paths) >= 8, paths
    missing = []
    for path in sorted(paths):
        # A family's own folder: the probe's for the tests, a shipped one's for the package.
        family = "probe" if path.startswith("tests/") else "dflash"
        resolved = ROOT / path.replace("<family>", family)
        if "<family>" in path and path.startswith("configs/"):
            resolved = ROOT / "configs" / "quickstart" / "dflash.yaml"
        if not resolved.exists():
            missing.append(path)
    assert not missing, f"{GUIDE} names places that do not exist: {missing}"


def test_the_guide_numbers_its_steps_in_order():
    numbers = [int(n) for n in re.findall(r"^(\d+)\. ", guide(), flags=re.MULTILINE)]
    assert numbers == list(range(1, len(numbers) + 1)) and len(numbers) >= 7, numbers
