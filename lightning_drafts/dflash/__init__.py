"""DFlash and DFlash2: block-parallel drafts (docs/concepts/dflash.md) on the shared anchor / block-mask
layer."""

from lightning_drafts.dflash.dflash2_module import DFlash2Module
from lightning_drafts.dflash.export import export_draft
from lightning_drafts.dflash.module import DFlashModule
from lightning_drafts.dflash.reload import load_exported_draft

__all__ = ["DFlash2Module", "DFlashModule", "export_draft", "load_exported_draft"]
