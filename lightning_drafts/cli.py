"""The ``lightning-drafts`` command: LightningCLI over the draft modules and the packed chat data."""

from __future__ import annotations

from lightning.pytorch import LightningDataModule
from lightning.pytorch.cli import LightningCLI

from lightning_drafts.base import DraftModule


def main(args: list[str] | None = None) -> LightningCLI:
    """``lightning-drafts fit --config ...``; any ``DraftModule`` subclass and data module by class path."""
    return LightningCLI(
        DraftModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=args,
    )
