"""EAGLE-3's record in the family registry: dense (Llama-style) and MLA drafts."""

from __future__ import annotations

from lightning_drafts.eagle3.export_check import validate_eagle3_export
from lightning_drafts.eagle3.layout import DENSE_ARCHITECTURE, MLA_ARCHITECTURE
from lightning_drafts.eagle3.module import Eagle3Module, MLAEagle3Module
from lightning_drafts.eagle3.speculate import default_num_steps, load_speculator, load_training_module
from lightning_drafts.serving.family import DraftFamily

FAMILY = DraftFamily(
    name="EAGLE-3",
    modules=(Eagle3Module, MLAEagle3Module),
    architectures=(DENSE_ARCHITECTURE, MLA_ARCHITECTURE),
    validate=validate_eagle3_export,
    load_speculator=load_speculator,
    load_training_module=load_training_module,
    default_num_steps=default_num_steps,
    vllm_methods={DENSE_ARCHITECTURE: "eagle3", MLA_ARCHITECTURE: "eagle3"},
    # SGLang has no model for the MLA draft's layout (Eagle3DeepseekV2ForCausalLM is vLLM's).
    sglang_algorithms={DENSE_ARCHITECTURE: "EAGLE3"},
)
