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
    # Both layouts load into vLLM's Qwen3 DSpark model (tests/families/test_vllm_layouts.py), which only
    # vLLM's V2 model runner serves: its CPU build refuses to.
    vllm_methods={architecture: "dspark" for architecture in LAYOUTS.values()},
    # SGLang loads SpecForge's layout; NeMo's (with the embedding / LM head copies) is not its model.
    sglang_algorithms={LAYOUTS["specforge"]: "DSPARK"},
)
