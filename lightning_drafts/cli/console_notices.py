"""What the console shows a user of ``lightning-drafts``: our dependencies' notices that no user of this
command can act on are left out.

* torch 2.13 deprecates ``isinstance(x, LeafSpec)``, which Lightning 2.6 itself calls: a warning on every
  run that only a Lightning release can remove;
* Lightning 2.6 suggests installing ``litlogger`` whenever a run has no LitLogger: an advertisement, on every
  run, for a logger this project does not use (its runs log to TensorBoard).

Everything else (our warnings, a dependency's warning about how it is used) still shows.
"""

from __future__ import annotations

import logging
import warnings

DEPENDENCY_DEPRECATIONS = (r"`isinstance\(treespec, LeafSpec\)` is deprecated",)
LIGHTNING_TIP = "💡 Tip:"
# The loggers Lightning's rank_zero_info writes through (the last of them imported is the one in use).
LIGHTNING_INFO_LOGGERS = ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero")


class _DropLightningTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(LIGHTNING_TIP)


def leave_out_dependency_notices() -> None:
    """Install the filters (idempotent: a filter already installed is not added twice)."""
    for message in DEPENDENCY_DEPRECATIONS:
        warnings.filterwarnings("ignore", message=message)
    for name in LIGHTNING_INFO_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropLightningTips) for f in logger.filters):
            logger.addFilter(_DropLightningTips())
