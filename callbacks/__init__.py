"""Callbacks that turn each step's DraftOutput and batch into training logs."""

from callbacks.acceptance import AcceptanceCallback

__all__ = ["AcceptanceCallback"]
