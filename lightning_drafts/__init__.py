"""lightning-drafts: Lightning training of speculative-decoding draft models with exact sequence packing.

The package is layered (lower layers never import higher ones; ``lint-imports`` checks it):
``core`` < ``attention`` < ``training`` (+ ``datamodules``, the training ``callbacks``) < ``serving`` <
``blockdraft`` < the families (``eagle3``, ``dflash``, ``dspark``) < ``registry`` < ``workflows`` <
``cli``. This module is the public facade over all of them.
"""

from lightning_drafts.callbacks import AcceptanceCallback, ServedAcceptanceCallback, ThroughputCallback
from lightning_drafts.core.batch import PackedBatch, validate_batch
from lightning_drafts.core.draft_output import DraftOutput
from lightning_drafts.datamodules import PackedChatDataModule
from lightning_drafts.dflash import DFlash2Module, DFlashModule
from lightning_drafts.dspark import DSparkModule
from lightning_drafts.eagle3 import Eagle3Module, MLAEagle3Module
from lightning_drafts.training.module import DraftModule
from lightning_drafts.training.target import FrozenTarget
from lightning_drafts.workflows.evaluate import evaluate_export
from lightning_drafts.workflows.export import export_checkpoint, validate_export

__all__ = [
    "AcceptanceCallback",
    "DFlash2Module",
    "DFlashModule",
    "DraftModule",
    "DraftOutput",
    "DSparkModule",
    "Eagle3Module",
    "FrozenTarget",
    "MLAEagle3Module",
    "PackedBatch",
    "PackedChatDataModule",
    "ServedAcceptanceCallback",
    "ThroughputCallback",
    "evaluate_export",
    "export_checkpoint",
    "validate_export",
    "validate_batch",
]
