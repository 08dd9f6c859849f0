"""Callbacks that turn each step's DraftOutput and batch into training logs.

Each name loads on first use: ``DraftModule`` imports ``lightning_drafts.callbacks.acceptance`` while
the training layer itself is being imported, and ``ServedAcceptanceCallback`` lives in the workflows
layer (it exports and serves the draft), which imports the training layer. Loading every callback with
this package would make the training layer import the layers above it.
"""

from __future__ import annotations

from lightning_drafts.core.lazy_names import lazy_names

# Public name -> the module that defines it.
_PUBLIC = {
    "AcceptanceCallback": "lightning_drafts.callbacks.acceptance",
    "DataMatchCallback": "lightning_drafts.callbacks.data_match",
    "DraftRichProgressBar": "lightning_drafts.callbacks.progress",
    "DraftTQDMProgressBar": "lightning_drafts.callbacks.progress",
    "PreemptionCheckpoint": "lightning_drafts.callbacks.preemption",
    "ServedAcceptanceCallback": "lightning_drafts.workflows.served_acceptance",
    "SlowStepsNotice": "lightning_drafts.callbacks.slow_steps",
    "ThroughputCallback": "lightning_drafts.callbacks.throughput",
}
__all__ = sorted(_PUBLIC)


__getattr__, __dir__ = lazy_names(__name__, _PUBLIC)
