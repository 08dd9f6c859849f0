"""Write a trained EAGLE-3 draft in its serving layout (:mod:`lightning_drafts.eagle3.reload` loads it back).

Both drafts write ``<dir>/config.json`` and ``<dir>/model.safetensors``.

**Dense draft** (:class:`Eagle3Module`): the ``LlamaForCausalLMEagle3`` layout vLLM and SGLang load.

* Weights (no ``model.`` prefix; vLLM adds it and renames ``midlayer.`` to ``layers.0.``, SGLang reads
  ``midlayer.`` as is): ``embed_tokens.weight`` (frozen copy of the target's), ``fc.weight``
  ``[H, 3 H_t]``, ``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight``,
  ``midlayer.self_attn.{q,k,v,o}_proj.weight`` (q/k/v input width ``2H``),
  ``midlayer.mlp.{gate,up,down}_proj.weight`` (their ``.bias`` where the target has ``attention_bias`` /
  ``mlp_bias`` and ``draft_biases`` is not False: vLLM alone serves those, see
  :data:`~lightning_drafts.eagle3.layout.BIAS_READERS`; the export warns), ``norm.weight``, ``lm_head.weight``
  ``[V_d, H]``, ``d2t`` (int64 ``[V_d]``, offsets: ``target id = draft id + d2t[draft id]``; the only
  mapping both engines read), ``t2d`` (bool ``[V]``; skipped by the engines, kept for training resume).
* ``config.json``: a Llama config of one layer (``num_hidden_layers: 1``) with the target's head layout,
  RoPE (``rope_theta``, ``rope_scaling``), ``vocab_size = V``, ``draft_vocab_size = V_d``,
  ``target_hidden_size``, ``tie_word_embeddings: false``, and the captured layers in **both** engine
  conventions (see :func:`~lightning_drafts.eagle3.layout.layer_id_fields`).

**MLA draft** (:class:`MLAEagle3Module`): the ``Eagle3DeepseekV2ForCausalLM`` layout vLLM loads
(``model_executor/models/deepseek_eagle3.py``); it also reloads with
:func:`~lightning_drafts.eagle3.reload.load_eagle3`.

* Weights: as the dense draft (vLLM folds ``gate_proj`` / ``up_proj`` into ``gate_up_proj``), except the
  attention: ``midlayer.self_attn.q_a_proj.weight`` ``[q_lora_rank, 2H]``, ``q_a_layernorm.weight``,
  ``q_b_proj.weight`` ``[n (nope + rope), q_lora_rank]`` (or a single ``q_proj.weight``
  ``[n (nope + rope), 2H]`` when ``q_lora_rank`` is null), ``kv_a_proj_with_mqa.weight``
  ``[kv_lora_rank + rope, 2H]`` (latent, then the one shared rope key; vLLM stacks it under ``q_a_proj``
  into ``fused_qkv_a_proj``), ``kv_a_layernorm.weight``, ``kv_b_proj.weight``
  ``[n (nope + v_head_dim), kv_lora_rank]`` (per head: nope key, then value), ``o_proj.weight``
  ``[H, n v_head_dim]``; the MLP is dense SwiGLU. Per head the query is ``[nope, rope]`` and the rope
  dims rotate as adjacent pairs ``(2i, 2i + 1)``, vLLM's ``is_neox_style=False``.
* ``config.json``: ``model_type: deepseek_v2`` (vLLM turns any ``deepseek_v3`` draft config into its MTP
  model; the V2 config has the same MLA fields), ``num_hidden_layers: 1``, ``hidden_size``,
  ``num_attention_heads``, ``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``,
  ``v_head_dim``, ``intermediate_size`` (the dense FFN width), ``hidden_act: silu``, ``rms_norm_eps``,
  ``max_position_embeddings``, ``rope_theta``, ``rope_scaling`` (the rotation the draft computes, in vLLM's
  terms: ``null`` for plain RoPE, or the YaRN ramp with ``mscale`` and ``mscale_all_dim`` 0, since the draft
  scales neither cos / sin nor the softmax; see
  :func:`~lightning_drafts.eagle3.rope.vllm_deepseek_rope_scaling`), ``rope_interleave: true``,
  ``vocab_size``, ``draft_vocab_size``, ``target_hidden_size``, and the same layer-id fields as the dense
  draft. vLLM 0.32 cannot load a draft whose ``q_lora_rank`` is null (its loader folds
  ``kv_a_proj_with_mqa`` into ``fused_qkv_a_proj``, which exists only with ``q_lora_rank``): such an export
  warns, and serves with ``lightning-drafts evaluate`` only.

Both configs carry a ``lightning_drafts`` section (``draft_class``, ``target_layer_ids``, ``ttt_length``,
``loss_decay_gamma``, ``draft_vocab_size``, ``target`` when it is a hub id / path / config dict,
``target_seed``, ``init_fingerprints`` of the LM head's random initialisation, or of ``fc``'s when the head
started as the target's) that :func:`~lightning_drafts.eagle3.reload.load_eagle3` uses to rebuild the
module and the validator uses to prove the draft was trained.

``lightning-drafts export`` checks every export with
:func:`~lightning_drafts.eagle3.export_check.validate_eagle3_export` before it lands in the output directory.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lightning_drafts.eagle3.draft_base import Eagle3Draft
from lightning_drafts.eagle3.layout import (
    BIAS_READERS,
    DENSE_ARCHITECTURE,
    MLA_ARCHITECTURE,
    MLA_MODEL_TYPE,
    bias_tensors,
    layer_id_fields,
)
from lightning_drafts.eagle3.mla_draft import MLAEagle3Draft
from lightning_drafts.eagle3.rope import vllm_deepseek_rope_scaling
from lightning_drafts.serving.export_files import write_export


def serving_config(
    draft: Eagle3Draft, target_layer_ids: Sequence[int], record: dict[str, Any]
) -> dict[str, Any]:
    """The ``config.json`` of ``draft``, with ``record`` as its ``lightning_drafts`` section."""
    draft_config = draft.config.to_dict()
    rope_theta, rope_scaling = draft_config.pop("rope_theta"), draft_config.pop("rope_scaling")
    draft_config.pop("initializer_range")
    dtype = str(draft.fc.weight.dtype).removeprefix("torch.")
    common = {
        **draft_config,
        "num_hidden_layers": 1,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        **layer_id_fields(target_layer_ids),
        "lightning_drafts": record,
    }
    if isinstance(draft, MLAEagle3Draft):
        return {
            "architectures": [MLA_ARCHITECTURE],
            "model_type": MLA_MODEL_TYPE,
            "hidden_act": "silu",
            "rope_interleave": True,
            **common,
            "rope_scaling": vllm_deepseek_rope_scaling(rope_scaling, draft_config["max_position_embeddings"]),
        }
    return {"architectures": [DENSE_ARCHITECTURE], "model_type": "llama", **common}


def export_draft(
    draft: Eagle3Draft,
    output_dir: str | Path,
    *,
    draft_class: str,
    target_layer_ids: Sequence[int],
    ttt_length: int,
    loss_decay_gamma: float,
    target_record: Mapping[str, Any],
    init_fingerprints: Mapping[str, Any],
    vocab_mapping_built: bool,
) -> Path:
    """Write ``config.json`` and ``model.safetensors`` for ``draft`` into ``output_dir`` (all or nothing).

    ``draft_class`` names the module :func:`~lightning_drafts.eagle3.reload.load_eagle3` rebuilds; the
    other arguments are that module's training settings, recorded under ``lightning_drafts``."""
    if not vocab_mapping_built:
        raise ValueError(
            "the draft vocabulary mapping is not built, so d2t would map draft ids to the first V_d target ids; "
            "build it (build_vocab_mapping / token_frequencies / fit) before exporting"
        )
    if isinstance(draft, MLAEagle3Draft) and draft.config.q_lora_rank is None:
        warnings.warn(
            "this MLA draft has no q_lora_rank (its target's is null): vLLM 0.32's Eagle3DeepseekV2ForCausalLM "
            "cannot load it (its loader folds kv_a_proj_with_mqa into fused_qkv_a_proj, which it builds only with "
            "q_lora_rank); `lightning-drafts evaluate` serves the export, vLLM refuses it",
            stacklevel=2,
        )
    state = draft.state_dict()
    biases = bias_tensors(state)
    if biases:
        warnings.warn(
            f"this draft has decoder-layer biases {biases} (its target has them): {BIAS_READERS}; for those engines "
            "train with draft_biases=False",
            stacklevel=2,
        )
    record = {
        "draft_class": draft_class,
        "target_layer_ids": list(target_layer_ids),
        "layer_id_convention": "decoder-layer outputs, 0-based (HF hidden_states[id + 1])",
        "ttt_length": ttt_length,
        "loss_decay_gamma": loss_decay_gamma,
        "draft_vocab_size": draft.draft_vocab_size,
        **target_record,
        "init_fingerprints": dict(init_fingerprints),
    }
    return write_export(output_dir, serving_config(draft, target_layer_ids, record), state)
