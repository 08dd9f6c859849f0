"""DSpark exports: NeMo's self-contained ``Qwen3DSparkModel`` layout and the SpecForge / SGLang
``DSparkDraftModel`` serving layout (docs/concepts/dspark.md#serving-layout). Both are a directory with
``config.json`` and ``model.safetensors``; both reload into
:class:`~lightning_drafts.dspark.module.DSparkModule`.

Weights (no ``model.`` prefix; ``rotary_emb.inv_freq`` is never saved, readers rebuild it in fp32), with
V = vocabulary, H = hidden size, F = ``len(target_layer_ids)``, r = ``markov_rank``:

* both layouts: ``layers.N.self_attn.{q,k,v,o}_proj.weight``, ``layers.N.self_attn.{q,k}_norm.weight``
  ``[head_dim]``, ``layers.N.mlp.{gate,up,down}_proj.weight``,
  ``layers.N.{input,post_attention}_layernorm.weight`` ``[H]`` (Qwen3 shapes); ``norm.weight`` ``[H]``;
  ``fc.weight`` ``[H, F * H]``; ``hidden_norm.weight`` ``[H]``; ``markov_head.markov_w1.weight``
  ``[V, r]``; ``markov_head.markov_w2.weight`` ``[V, r]`` (a Linear r -> V); the gated head's
  ``markov_head.gate_proj.weight`` ``[r, H + r]`` / ``.bias`` ``[r]`` (input: slot state, then the
  previous token's latent), the rnn head's ``markov_head.joint_proj.weight`` ``[3 r, 2 r + H]`` /
  ``.bias`` ``[3 r]`` (input: state, latent, slot state; output: gate, candidate, output);
  ``confidence_head.proj.weight`` ``[1, H (+ r with confidence_head_with_markov)]``,
  ``confidence_head.proj.bias`` ``[1]``;
* ``nemo`` only: ``embed_tokens.weight`` and ``lm_head.weight`` ``[V, H]`` (the frozen copies of the
  target's). SpecForge's and SGLang's servers reuse the target's embedding and head.

``config.json``, both layouts: the draft's Qwen3 fields (``vocab_size``, ``hidden_size``,
``intermediate_size``, ``num_hidden_layers`` = draft layers, ``num_attention_heads``,
``num_key_value_heads``, ``head_dim``, ``hidden_act``, ``max_position_embeddings``,
``initializer_range``, ``rms_norm_eps``, ``rope_parameters`` + top-level ``rope_theta`` (+ ``rope_scaling``
when not default) for transformers-4 readers, ``attention_bias`` false, ``tie_word_embeddings`` false,
``layer_types`` all ``full_attention``, ``sliding_window`` null, ``use_sliding_window`` false,
``max_window_layers``), ``model_type`` ``"qwen3"``, ``num_target_layers`` (L of the target),
``block_size`` (K), ``torch_dtype``, and ``lightning_drafts`` (the training hyperparameters that are not
architecture: num_anchors, loss weights, decay, layout).

* ``nemo``: ``architectures`` ``["Qwen3DSparkModel"]``; top level ``target_layer_ids`` (NeMo's -1 /
  L - 1 convention), ``num_anchors``, ``mask_token_id``, ``markov_rank``, ``markov_head_type``,
  ``enable_confidence_head``, ``confidence_head_with_markov``.
* ``specforge``: ``architectures`` ``["DSparkDraftModel"]``, ``is_causal`` false; ``dflash_config`` =
  ``{attention_mode: "gqa", mask_token_id, target_layer_ids, projector_type: "dspark", markov_rank,
  markov_head_type, confidence_head_alpha, enable_confidence_head, confidence_head_with_markov}``; the
  Markov / confidence fields are repeated at the top level, where SpecForge's ``DSparkConfig`` and SGLang's
  ``parse_dspark_draft_config`` (after an absent ``dspark_config``) read them. No ``auto_map``: the export
  ships no modelling code, and SpecForge / SGLang build the draft from their own classes. All three
  Markov heads are served (SpecForge ``dspark_heads.py``, SGLang ``models/dspark.py``: vanilla, gated,
  rnn); unfrozen embeddings are refused (the server reuses the target's; export ``layout="nemo"``).
  Standard SGLang captures features only for ids in ``[0, L - 2]`` (a warning at training time),
  refuses ``markov_rank`` 0 (SpecForge builds no head then), and builds the confidence head whatever
  ``enable_confidence_head`` says unless ``SGLANG_RAGGED_VERIFY_MODE=static`` (so an export without one
  loads there only in that mode).

Serving with SGLang: ``--speculative-algorithm DSPARK --speculative-draft-model-path <export>``; SGLang
takes gamma (drafted tokens) from ``block_size`` and requires ``--speculative-num-draft-tokens``, when
given, to be ``block_size + 1`` (its verify window: the anchor plus K proposals). Not run here: the
layout follows the SpecForge / SGLang loaders' source (see tests/families/dspark/test_dspark_export.py).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen3Config

from lightning_drafts.blockdraft.config_fields import qwen3_serving_fields
from lightning_drafts.dspark.draft import DSparkDraft
from lightning_drafts.dspark.layout import HEAD_FIELDS, LAYOUTS, TARGET_COPIES
from lightning_drafts.serving.export_files import write_export


def serving_config(
    draft_config: Qwen3Config,
    fields: dict[str, Any],
    layout: str,
    num_target_layers: int,
    training: dict[str, Any],
    dtype: torch.dtype,
) -> dict[str, Any]:
    """The ``config.json`` in ``layout`` (see the module docstring) of a draft built from ``draft_config``
    with the DSpark ``fields``; ``training`` is the ``lightning_drafts`` record (``layout`` is added)."""
    config = qwen3_serving_fields(draft_config)
    config.update(
        architectures=[LAYOUTS[layout]],
        model_type="qwen3",
        num_target_layers=num_target_layers,
        block_size=fields["block_size"],
        torch_dtype=str(dtype).removeprefix("torch."),
        **{name: fields[name] for name in HEAD_FIELDS},
    )
    if layout == "nemo":
        config.update(
            target_layer_ids=fields["target_layer_ids"],
            num_anchors=training["num_anchors"],
            mask_token_id=fields["mask_token_id"],
        )
    else:
        config.update(
            is_causal=False,
            dflash_config={
                "attention_mode": "gqa",
                "mask_token_id": fields["mask_token_id"],
                "target_layer_ids": fields["target_layer_ids"],
                "projector_type": "dspark",
                "confidence_head_alpha": training["confidence_head_alpha"],
                **{name: fields[name] for name in HEAD_FIELDS},
            },
        )
    config["lightning_drafts"] = {"layout": layout, **training}
    return config


def export_draft(
    draft: DSparkDraft,
    output_dir: Path,
    fields: dict[str, Any],
    num_target_layers: int,
    training: dict[str, Any],
    layout: str | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write ``draft`` to ``output_dir`` in ``layout`` (all or nothing); ``fields``, ``num_target_layers``
    and ``training`` as :func:`serving_config` takes them.

    ``layout=None``: the SpecForge / SGLang layout when this draft fits it, else NeMo's (with a warning
    saying why), so every trained DSpark draft exports and evaluates without being told."""
    unservable = _unservable_reason(draft)
    if layout is None:
        layout = "specforge" if unservable is None else "nemo"
        if unservable is not None:
            warnings.warn(f"{unservable}; writing NeMo's Qwen3DSparkModel layout instead", stacklevel=2)
    if layout not in LAYOUTS:
        raise ValueError(f"export layout {layout!r} is unknown; choose one of {sorted(LAYOUTS)}")
    state = draft.state_dict()
    if layout == "specforge":
        if unservable is not None:
            raise ValueError(
                f"{unservable}; export with layout='nemo' (`lightning-drafts export --layout nemo`)"
            )
        state = {key: value for key, value in state.items() if key not in TARGET_COPIES}
    dtype = dtype or draft.fc.weight.dtype
    tensors = {key: value.to(dtype) for key, value in state.items()}
    config = serving_config(draft.config, fields, layout, num_target_layers, training, dtype)
    return write_export(output_dir, config, tensors)


def _unservable_reason(draft: DSparkDraft) -> str | None:
    """Why SpecForge's / SGLang's ``DSparkDraftModel`` cannot serve this draft, or None."""
    trained = [key for key in TARGET_COPIES if draft.get_parameter(key).requires_grad]
    if trained:
        return (
            f"the SpecForge layout has no {trained}: the server reuses the target's, but this draft trained its "
            "own copies (freeze_embeddings=False)"
        )
    return None
