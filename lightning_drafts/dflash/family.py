"""DFlash's record in the family registry: DFlash and DFlash2 drafts."""

from __future__ import annotations

from lightning_drafts.dflash.dflash2_module import DFlash2Module
from lightning_drafts.dflash.export_check import validate_dflash_export
from lightning_drafts.dflash.layout import ARCHITECTURES, DFLASH2_ARCHITECTURE
from lightning_drafts.dflash.module import DFlashModule
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
    # SGLang's DFlash model has no in-block convolutions or path selector: DFlash only.
    sglang_algorithms={a: "DFLASH" for a in ARCHITECTURES if a != DFLASH2_ARCHITECTURE},
)
