"""What the console shows a user of ``lightning-drafts``: our dependencies' notices that no user of this
command can act on are left out.

* torch 2.13 deprecates ``isinstance(x, LeafSpec)``, which Lightning 2.6 itself calls: a warning on every
  run that only a Lightning release can remove;
* Lightning 2.6 suggests installing ``litlogger`` whenever a run has no LitLogger: an advertisement, on every
  run, for a logger this project does not use (its runs log to TensorBoard);
* Lightning notes, on every fit with a data module, that the module's own ``on_before_batch_transfer`` is
  used (``DraftModule`` adds the target workers' features there, on purpose: the data module has none);
* Lightning notes that a fit without a validation split has an empty list of validation loaders: the data
  module's own choice, and the fit says so itself ("no validation in this fit").

Everything else (our warnings, a dependency's warning about how it is used) still shows. A fit that resumes
its own run also leaves out Lightning's note that the run's checkpoint directory "exists and is not empty":
it holds that run's own checkpoints, which the resumed fit continues (:func:`leave_out_own_run_notice`).
"""

from __future__ import annotations

import logging
import warnings

DEPENDENCY_DEPRECATIONS = (
    r"`isinstance\(treespec, LeafSpec\)` is deprecated",
    r"You have overridden `on_before_batch_transfer` in `LightningModule` but have passed in a `LightningDataModule`",
    r"Total length of `list` across ranks is zero",
)
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


def leave_out_own_run_notice() -> None:
    """For a fit that resumes into its own run directory: drop ModelCheckpoint's note that the directory is
    not empty (a fit into another run's directory still gets it)."""
    warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
