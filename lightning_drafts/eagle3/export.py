"""Write a trained EAGLE-3 draft in its serving layout, and load it back.

Both drafts write ``<dir>/config.json`` and ``<dir>/model.safetensors``.

**Dense draft** (:class:`Eagle3Module`): the ``LlamaForCausalLMEagle3`` layout vLLM and SGLang load.

* Weights (no ``model.`` prefix; vLLM adds it and renames ``midlayer.`` to ``layers.0.``, SGLang reads
  ``midlayer.`` as is): ``embed_tokens.weight`` (frozen copy of the target's), ``fc.weight``
  ``[H, 3 H_t]``, ``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight``,
  ``midlayer.self_attn.{q,k,v,o}_proj.weight`` (q/k/v input width ``2H``; ``.bias`` iff the target has
  ``attention_bias``), ``midlayer.mlp.{gate,up,down}_proj.weight``, ``norm.weight``, ``lm_head.weight``
  ``[V_d, H]``, ``d2t`` (int64 ``[V_d]``, offsets: ``target id = draft id + d2t[draft id]``; the only
  mapping both engines read), ``t2d`` (bool ``[V]``; skipped by the engines, kept for training resume).
* ``config.json``: a Llama config of one layer (``num_hidden_layers: 1``) with the target's head layout,
  RoPE (``rope_theta``, ``rope_scaling``), ``vocab_size = V``, ``draft_vocab_size = V_d``,
  ``target_hidden_size``, ``tie_word_embeddings: false``, and the captured layers in **both** engine
  conventions (see :func:`layer_id_fields`).

**MLA draft** (:class:`MLAEagle3Module`): no serving engine loads an MLA EAGLE-3 draft today, so the
layout is this project's own, named ``LightningDraftsMLAEagle3`` so that an engine refuses it loudly
rather than mis-loading it. It reloads with :func:`load_eagle3`.

* Weights: as the dense draft, except the attention: ``midlayer.self_attn.q_a_proj.weight``
  ``[q_lora_rank, 2H]``, ``q_a_layernorm.weight``, ``q_b_proj.weight`` ``[n (nope + rope), q_lora_rank]``
  (or a single ``q_proj.weight`` ``[n (nope + rope), 2H]`` when ``q_lora_rank`` is null),
  ``kv_a_proj_with_mqa.weight`` ``[kv_lora_rank + rope, 2H]`` (latent, then the one shared rope key),
  ``kv_a_layernorm.weight``, ``kv_b_proj.weight`` ``[n (nope + v_head_dim), kv_lora_rank]`` (per head:
  nope key, then value), ``o_proj.weight`` ``[H, n v_head_dim]``; the MLP is dense SwiGLU.
* ``config.json``: ``model_type: deepseek_v3``, ``num_hidden_layers: 1``, ``hidden_size``,
  ``num_attention_heads``, ``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``,
  ``v_head_dim``, ``intermediate_size`` (the dense FFN width), ``hidden_act: silu``, ``rms_norm_eps``,
  ``max_position_embeddings``, ``rope_theta``, ``rope_scaling`` (YaRN ramp applied when complete; no
  ``mscale`` on the softmax scale), ``rope_interleave: true`` (pairs ``2i, 2i+1``), ``vocab_size``,
  ``draft_vocab_size``, ``target_hidden_size``, and the same layer-id fields as the dense draft.

Both configs carry a ``lightning_drafts`` section (``draft_class``, ``target_layer_ids``, ``ttt_length``,
``loss_decay_gamma``, ``draft_vocab_size``, ``target`` when it is a hub id / path / config dict,
``target_seed``, ``init_fingerprints`` of the LM head's random initialisation) that :func:`load_eagle3`
uses to rebuild the module and the validator uses to prove the LM head was trained.

Every export is checked by :func:`~lightning_drafts.eagle3.export_check.validate_eagle3_export` before
``export_eagle3`` returns. :func:`load_eagle3_draft` reads the draft the way a serving engine does (shapes
and RoPE from ``config.json``, weights from ``model.safetensors``), for ``lightning-drafts evaluate``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file

from lightning_drafts.eagle3.draft_base import Eagle3Draft
from lightning_drafts.eagle3.module import Eagle3Base, Eagle3Module, MLAEagle3Module

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
DENSE_ARCHITECTURE = "LlamaForCausalLMEagle3"
MLA_ARCHITECTURE = "LightningDraftsMLAEagle3"
DRAFT_CLASSES = {"Eagle3Module": Eagle3Module, "MLAEagle3Module": MLAEagle3Module}


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


def serving_config(module: Eagle3Base) -> dict[str, Any]:
    """The ``config.json`` of ``module``'s draft."""
    draft_config = module.draft.config.to_dict()
    rope_theta, rope_scaling = draft_config.pop("rope_theta"), draft_config.pop("rope_scaling")
    draft_config.pop("initializer_range")
    dtype = str(module.draft.fc.weight.dtype).removeprefix("torch.")
    common = {
        **draft_config,
        "num_hidden_layers": 1,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        **layer_id_fields(module.target_layer_ids),
        "lightning_drafts": _training_record(module),
    }
    if isinstance(module, MLAEagle3Module):
        return {
            "architectures": [MLA_ARCHITECTURE],
            "model_type": "deepseek_v3",
            "hidden_act": "silu",
            "rope_interleave": True,
            **common,
        }
    return {"architectures": [DENSE_ARCHITECTURE], "model_type": "llama", **common}


def export_eagle3(module: Eagle3Base, output_dir: str | Path) -> Path:
    """Write ``config.json`` and ``model.safetensors`` for ``module``'s draft into ``output_dir``."""
    if not bool(module.vocab_mapping_built):
        raise ValueError(
            "the draft vocabulary mapping is not built, so d2t would map draft ids to the first V_d target ids; "
            "build it (build_vocab_mapping / token_frequencies / fit) before exporting"
        )
    output = Path(output_dir)
    output.mkdir(parents=True, exist_ok=True)
    (output / CONFIG_FILE).write_text(json.dumps(serving_config(module), indent=2) + "\n")
    weights = {name: tensor.detach().cpu().contiguous() for name, tensor in module.draft.state_dict().items()}
    save_file(weights, str(output / WEIGHTS_FILE), metadata={"format": "pt"})
    # Imported here: the validator reads this module's layout constants.
    from lightning_drafts.eagle3.export_check import validate_eagle3_export

    validate_eagle3_export(output, target=module.target)
    return output


def load_eagle3_draft(directory: str | Path) -> tuple[Eagle3Draft, dict[str, Any]]:
    """The draft network and ``config.json`` of an export, read as a serving engine reads them.

    Shapes and RoPE come from ``config.json`` (not from the target), the weights (``d2t`` included) from
    ``model.safetensors``, loaded strictly in the dtype they were saved in. Run the validator first.
    """
    from lightning_drafts.eagle3.export_check import draft_from_serving_config

    directory = Path(directory)
    config = json.loads((directory / CONFIG_FILE).read_text())
    state = load_file(str(directory / WEIGHTS_FILE))
    draft = draft_from_serving_config(config).to(state["fc.weight"].dtype)
    draft.load_state_dict(state, strict=True)
    return draft.eval().requires_grad_(False), config


def load_eagle3(directory: str | Path, target: Any = None, **overrides: Any) -> Eagle3Base:
    """Rebuild the module an export came from, with its weights and vocabulary mapping.

    ``target`` defaults to the one recorded at export (a hub id, path or config dict); pass it when the
    export was made from a ``PreTrainedModel`` instance. ``overrides`` go to the module constructor.
    """
    directory = Path(directory)
    config = json.loads((directory / CONFIG_FILE).read_text())
    record = config.get("lightning_drafts")
    if not record or record.get("draft_class") not in DRAFT_CLASSES:
        raise ValueError(
            f"{directory / CONFIG_FILE} has no lightning_drafts record of an EAGLE-3 draft; it was not written "
            "by export_eagle3"
        )
    target = record.get("target") if target is None else target
    if target is None:
        raise ValueError(
            f"{directory} does not record its target; pass target= (hub id, path, config or model)"
        )
    arguments = {
        "target_layer_ids": record["target_layer_ids"],
        "ttt_length": record["ttt_length"],
        "draft_vocab_size": record["draft_vocab_size"],
        "loss_decay_gamma": record["loss_decay_gamma"],
        "target_seed": record.get("target_seed", 0),
        **overrides,
    }
    module = DRAFT_CLASSES[record["draft_class"]](target=target, **arguments)
    _check_same_target(module, config, directory)
    module.draft.load_state_dict(load_file(str(directory / WEIGHTS_FILE)), strict=True)
    module.vocab_mapping_built.fill_(True)
    # The original init, not the one just overwritten, is what a re-export must be checked against.
    module.init_fingerprints = dict(record.get("init_fingerprints") or {})
    return module


def _training_record(module: Eagle3Base) -> dict[str, Any]:
    return {
        "draft_class": _family(module),
        "target_layer_ids": list(module.target_layer_ids),
        "layer_id_convention": "decoder-layer outputs, 0-based (HF hidden_states[id + 1])",
        "ttt_length": module.hparams.ttt_length,
        "loss_decay_gamma": module.hparams.loss_decay_gamma,
        "draft_vocab_size": module.draft.draft_vocab_size,
        **module.target_record(),
        "init_fingerprints": dict(getattr(module, "init_fingerprints", {})),
    }


def _family(module: Eagle3Base) -> str:
    return "MLAEagle3Module" if isinstance(module, MLAEagle3Module) else "Eagle3Module"


def _check_same_target(module: Eagle3Base, config: dict[str, Any], directory: Path) -> None:
    expected = {
        "vocab_size": module.target.vocab_size,
        "target_hidden_size": module.target.text_config.hidden_size,
    }
    wrong = {key: (config.get(key), value) for key, value in expected.items() if config.get(key) != value}
    if wrong:
        details = ", ".join(
            f"{key}: export {saved} vs target {actual}" for key, (saved, actual) in wrong.items()
        )
        raise ValueError(f"{directory} was trained against a different target ({details})")
