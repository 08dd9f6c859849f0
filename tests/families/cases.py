"""Every family's conformance cases, keyed by module class; the probe family's too (registered only
while a test runs, see the ``family`` fixture in tests/conftest.py)."""

from __future__ import annotations

from lightning_drafts.registry import REGISTRY
from lightning_drafts.serving.family import DraftFamily
from tests.families.dflash.cases import CASES as DFLASH
from tests.families.dspark.cases import CASES as DSPARK
from tests.families.eagle3.cases import CASES as EAGLE3
from tests.families.family_case import FamilyCase
from tests.families.probe import PROBE
from tests.families.probe.cases import CASES as PROBE_CASES

CASES: dict[type, FamilyCase] = {**EAGLE3, **DFLASH, **DSPARK, **PROBE_CASES}
# The shipped families, then the probe: the suite runs the same checks on a family the library never saw.
FAMILIES: tuple[DraftFamily, ...] = (*REGISTRY.families, PROBE)
