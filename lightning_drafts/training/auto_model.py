"""The transformers auto class that builds a target from its config: a causal LM, or a vision-language model
whose language model a draft trains on with text alone (Qwen2.5-VL, Qwen3-VL: transformers maps their
configs to an image-text-to-text class only, which holds the text decoder and the LM head)."""

from __future__ import annotations

from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, PretrainedConfig


def target_model_class(config: PretrainedConfig) -> type:
    """``AutoModelForCausalLM`` where it maps ``config``, else ``AutoModelForImageTextToText`` where that does
    (its language model is the decoder the target runs); any other config gets ``AutoModelForCausalLM``,
    whose error names the classes it knows."""
    if type(config) not in AutoModelForCausalLM._model_mapping and type(config) in (
        AutoModelForImageTextToText._model_mapping
    ):
        return AutoModelForImageTextToText
    return AutoModelForCausalLM
