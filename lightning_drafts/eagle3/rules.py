"""The rule of the EAGLE-3 hyperparameter its export carries three times over (vLLM's, SGLang's and the
recorded training ids): the modules check ``target_layer_ids`` with it and ``validate_eagle3_export``
checks every exported copy with it."""

from __future__ import annotations

from lightning_drafts.core.layer_ids import layer_ids_rule

TARGET_LAYER_IDS = layer_ids_rule(
    "three distinct, strictly increasing, non-negative layer ids (decoder-layer outputs, HF "
    "hidden_states[id + 1])",
    count=3,
)
