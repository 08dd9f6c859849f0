"""Every family's conformance cases, keyed by module class; the probe family's too (registered only
while a test runs, see the ``family`` fixture in tests/conftest.py)."""

from __future__ import annotations

import importlib
from pathlib import Path

from lightning_drafts.registry import REGISTRY
from lightning_drafts.serving.family import DraftFamily
from tests.families.family_case import FamilyCase
from tests.families.probe import PROBE

# Each family folder's cases.py, found by listing the folders: a new family's cases need no line here.
FOLDERS = sorted(p.parent.name for p in Path(__file__).parent.glob("*/cases.py"))
_FOUND = {
    module: case
    for folder in FOLDERS
    for module, case in importlib.import_module(f"tests.families.{folder}.cases").CASES.items()
}
# In the registry's order (the probe, not registered, last): test ids and generated pages keep one order.
_ORDER = [module for family in REGISTRY.families for module in family.modules]
CASES: dict[type, FamilyCase] = dict(
    sorted(_FOUND.items(), key=lambda item: _ORDER.index(item[0]) if item[0] in _ORDER else len(_ORDER))
)
# The shipped families, then the probe: the suite runs the same checks on a family the library never saw.
FAMILIES: tuple[DraftFamily, ...] = (*REGISTRY.families, PROBE)
