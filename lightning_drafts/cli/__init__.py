"""The ``lightning-drafts`` command: ``fit`` / ``validate`` (LightningCLI), ``export``, ``evaluate``."""

from lightning_drafts.cli.main import main, run_cli

__all__ = ["main", "run_cli"]
