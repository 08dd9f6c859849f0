"""DFlash's record in the family registry: DFlash and DFlash2 drafts."""

from __future__ import annotations

from lightning_drafts.dflash.export_check import validate_dflash_export
from lightning_drafts.dflash.layout import ARCHITECTURES
from lightning_drafts.dflash.module import DFlash2Module, DFlashModule
from lightning_drafts.dflash.speculate import default_num_steps, load_speculator, load_training_module
from lightning_drafts.serving.family import DraftFamily

FAMILY = DraftFamily(
    name="DFlash",
    modules=(DFlashModule, DFlash2Module),
    architectures=tuple(ARCHITECTURES),
    validate=validate_dflash_export,
    load_speculator=load_speculator,
    load_training_module=load_training_module,
    default_num_steps=default_num_steps,
    # vLLM tells DFlash2 from DFlash by the architecture; both are its "dflash" method.
    vllm_methods={architecture: "dflash" for architecture in ARCHITECTURES},
)
