"""The one subprocess timeout of the suite: a guard against a hung child, never a speed check.

A test proves behaviour, not speed, so every subprocess a test starts gets this same limit, far above the
slowest honest run of any of them on an idle 2-core machine (a few minutes). A slower machine raises it
with ``LIGHTNING_DRAFTS_TEST_TIMEOUT_SCALE`` (e.g. ``4``) instead of editing tests.
"""

from __future__ import annotations

import os

SCALE_ENV = "LIGHTNING_DRAFTS_TEST_TIMEOUT_SCALE"
# The slowest subprocess of the suite (the vLLM serving scripts, the FSDP2 recipes on CPU) takes a few
# minutes on an idle 2-core machine; an hour is well over 10x that.
BASE_S = 3600.0


def hang_guard_s() -> float:
    """Seconds a test waits for one subprocess before calling it hung."""
    raw = os.environ.get(SCALE_ENV, "1")
    try:
        scale = float(raw)
    except ValueError:
        raise ValueError(f"{SCALE_ENV}={raw!r} is not a number; set it to a factor such as 2 or 4") from None
    if not scale > 0:
        raise ValueError(f"{SCALE_ENV}={raw!r} must be above 0 (a factor on the {BASE_S:.0f} s hang guard)")
    return BASE_S * scale


HANG_GUARD_S = hang_guard_s()
