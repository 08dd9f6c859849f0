"""Callbacks that turn each step's DraftOutput and batch into training logs."""

from callbacks.acceptance import AcceptanceCallback
from callbacks.served_acceptance import ServedAcceptanceCallback
from callbacks.throughput import ThroughputCallback

__all__ = ["AcceptanceCallback", "ServedAcceptanceCallback", "ThroughputCallback"]
