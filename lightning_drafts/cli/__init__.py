"""The ``lightning-drafts`` command: ``fit`` / ``validate`` (LightningCLI), ``export``, ``evaluate``."""

from lightning_drafts.cli.main import main

__all__ = ["main"]
