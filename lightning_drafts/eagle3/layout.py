"""The names of EAGLE-3's serving layouts, shared by the writer, the validator and the reader."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

DENSE_ARCHITECTURE = "LlamaForCausalLMEagle3"
# vLLM's DeepSeek MLA EAGLE-3 draft (model_executor/models/deepseek_eagle3.py).
MLA_ARCHITECTURE = "Eagle3DeepseekV2ForCausalLM"
# Not "deepseek_v3": vLLM rewrites every deepseek_v3 draft config into its DeepSeek MTP model
# (SpeculativeConfig.hf_config_override), so the EAGLE-3 class would never be built. The DeepSeek-V2 config
# names the same MLA fields.
MLA_MODEL_TYPE = "deepseek_v2"
# The draft's tensors whose random initialisation may be fingerprinted at construction, so the validator
# can prove the exported one was trained: the LM head, or ``fc`` when the head starts as the target's rows.
INIT_CHECKED_TENSORS = ("lm_head.weight", "fc.weight")


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


# Who serves a draft with biases in its decoder layer, from the engines' source: vLLM's llama_eagle3
# builds q/k/v and o_proj biases from ``attention_bias`` and MLP biases from ``mlp_bias``; SGLang's
# LlamaForCausalLMEagle3 overrides qkv_proj with bias=False, builds its MLP without biases and skips
# checkpoint weights it has no parameter for; SpecForge's builds every projection without bias.
BIAS_READERS = (
    "vLLM reads attention_bias / mlp_bias and serves them, but SGLang's and SpecForge's LlamaForCausalLMEagle3 "
    "build no q/k/v or MLP biases (SGLang drops those weights silently and serves a different draft)"
)


def bias_tensors(names: Iterable[str]) -> list[str]:
    """The decoder-layer bias tensors among ``names`` (what only vLLM of the EAGLE-3 engines reads fully)."""
    return sorted(name for name in names if name.startswith("midlayer.") and name.endswith(".bias"))
