"""The names of EAGLE-3's serving layouts, shared by the writer, the validator and the reader."""

from __future__ import annotations

from typing import Any

DENSE_ARCHITECTURE = "LlamaForCausalLMEagle3"
MLA_ARCHITECTURE = "LightningDraftsMLAEagle3"
# The draft's tensors whose random initialisation is fingerprinted at construction, so the validator can
# prove the exported ones were trained.
INIT_CHECKED_TENSORS = ("lm_head.weight",)


def layer_id_fields(target_layer_ids: list[int]) -> dict[str, Any]:
    """The captured layers as each serving engine reads them.

    Training ids name decoder-layer **outputs** (HF ``hidden_states[id + 1]``). SGLang (and SpecForge)
    read ``eagle_config.eagle_aux_hidden_state_layer_ids`` in that same convention and add 1 internally.
    vLLM reads a top-level ``eagle_aux_hidden_state_layer_ids`` as the index of the layer whose *input*
    it captures, i.e. ``id + 1``. Writing the training ids into vLLM's field is the classic off-by-one
    that silently collapses acceptance, so each field gets its own convention.
    """
    return {
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in target_layer_ids],
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(target_layer_ids),
            "use_aux_hidden_state": True,
        },
    }
