"""lightning-drafts: Lightning training of speculative-decoding draft models with exact sequence packing."""

from lightning_drafts.base import DraftModule
from lightning_drafts.batch import PackedBatch, validate_batch
from lightning_drafts.dflash import DFlash2Module, DFlashModule
from lightning_drafts.draft_output import DraftOutput
from lightning_drafts.dspark import DSparkModule
from lightning_drafts.eagle3 import Eagle3Module, MLAEagle3Module
from lightning_drafts.target import FrozenTarget

__all__ = [
    "DFlash2Module",
    "DFlashModule",
    "DraftModule",
    "DraftOutput",
    "DSparkModule",
    "Eagle3Module",
    "FrozenTarget",
    "MLAEagle3Module",
    "PackedBatch",
    "validate_batch",
]
