"""DSpark's record in the family registry: SpecForge's (SGLang) and NeMo's export layouts."""

from __future__ import annotations

from lightning_drafts.dspark.export_check import validate_dspark_export
from lightning_drafts.dspark.layout import LAYOUTS
from lightning_drafts.dspark.module import DSparkModule
from lightning_drafts.dspark.speculate import default_num_steps, load_speculator, load_training_module
from lightning_drafts.serving.family import DraftFamily

FAMILY = DraftFamily(
    name="DSpark",
    modules=(DSparkModule,),
    architectures=tuple(LAYOUTS.values()),
    validate=validate_dspark_export,
    load_speculator=load_speculator,
    load_training_module=load_training_module,
    default_num_steps=default_num_steps,
    layouts=tuple(LAYOUTS),
    # SpecForge's layout is the one vLLM maps onto its Qwen3 DSpark model; NeMo's self-contained layout
    # (embedding and LM head inside) is not one vLLM's DSpark reader was checked against.
    vllm_methods={LAYOUTS["specforge"]: "dspark"},
)
