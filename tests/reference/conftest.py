"""Every test here needs the reference wheel: fetched (once) by ``.ci/reference-env`` when
``$LIGHTNING_DRAFTS_REFERENCE_ROOT`` is unset. When it cannot be had, the tests fail with the reason and the
command to run; they are never skipped (they are what says the objectives are right)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.nemo_reference import ReferenceUnavailable, reference_root


@pytest.fixture(scope="session", autouse=True)
def reference() -> Path:
    try:
        return reference_root()
    except ReferenceUnavailable as error:
        pytest.fail(str(error), pytrace=False)
