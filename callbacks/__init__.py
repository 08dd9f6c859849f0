"""Callbacks that turn each step's DraftOutput and batch into training logs."""

from lightning_drafts.callbacks.acceptance import AcceptanceCallback
from lightning_drafts.callbacks.data_match import DataMatchCallback
from lightning_drafts.callbacks.preemption import PreemptionCheckpoint
from lightning_drafts.callbacks.progress import DraftRichProgressBar, DraftTQDMProgressBar
from lightning_drafts.callbacks.served_acceptance import ServedAcceptanceCallback
from lightning_drafts.callbacks.slow_steps import SlowStepsNotice
from lightning_drafts.callbacks.throughput import ThroughputCallback

__all__ = [
    "AcceptanceCallback",
    "DataMatchCallback",
    "DraftRichProgressBar",
    "DraftTQDMProgressBar",
    "PreemptionCheckpoint",
    "ServedAcceptanceCallback",
    "SlowStepsNotice",
    "ThroughputCallback",
]
