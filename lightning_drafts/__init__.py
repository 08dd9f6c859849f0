"""lightning-drafts: Lightning training of speculative-decoding draft models with exact sequence packing.

The package is layered (lower layers never import higher ones; ``lint-imports`` checks it):
``datamodules`` < ``core`` < ``attention`` < ``training`` (+ the training ``callbacks``) < ``serving`` <
``blockdraft`` < the families (``eagle3``, ``dflash``, ``dspark``) < ``registry`` < ``workflows`` <
``cli``. This module is the public facade over all of them. Its names load on first use, so that
``lightning-drafts --help`` answers without importing torch and Lightning.
"""

from __future__ import annotations

from lightning_drafts.core.lazy_names import lazy_names

# Public name -> the module that defines it.
_PUBLIC = {
    "AcceptanceCallback": "lightning_drafts.callbacks",
    "ServedAcceptanceCallback": "lightning_drafts.callbacks",
    "ThroughputCallback": "lightning_drafts.callbacks",
    "PackedBatch": "lightning_drafts.core.batch",
    "validate_batch": "lightning_drafts.core.batch",
    "DraftOutput": "lightning_drafts.core.draft_output",
    "PackedChatDataModule": "lightning_drafts.datamodules",
    "DFlashModule": "lightning_drafts.dflash",
    "DFlash2Module": "lightning_drafts.dflash",
    "DSparkModule": "lightning_drafts.dspark",
    "Eagle3Module": "lightning_drafts.eagle3",
    "MLAEagle3Module": "lightning_drafts.eagle3",
    "DraftModule": "lightning_drafts.training.module",
    "FrozenTarget": "lightning_drafts.training.target",
    "evaluate_export": "lightning_drafts.workflows.evaluate",
    "export_checkpoint": "lightning_drafts.workflows.export",
    "validate_export": "lightning_drafts.workflows.export",
}
__all__ = sorted(_PUBLIC)


__getattr__, __dir__ = lazy_names(__name__, _PUBLIC)
