"""DFlash's conformance cases (DFlash and DFlash2) and the builders its served tests share."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from lightning_drafts import DFlash2Module, DFlashModule
from tests.families.family_case import ROOT, FamilyCase, anchor_inputs, padded_anchor_inputs
from tests.support.block_draft_cases import BLOCK, MASK_TOKEN, perturb
from tests.support.builders import TINY_TARGETS, packed_row, random_docs, stack_rows

MASK = MASK_TOKEN  # reserved: never in a prompt or a training document
EOS = 1
DFLASH2_SIZES = {"conv_group_size": 4, "selector_rank": 8, "selector_top_k": 4}
FAMILIES = [(DFlashModule, {}), (DFlash2Module, DFLASH2_SIZES)]
FAMILY_IDS = ["dflash", "dflash2"]
LAST_LAYER = TINY_TARGETS["qwen3"]["num_hidden_layers"] - 1
# The last id is the target's last layer, so shifting the ids by one leaves the target.
TRAINED_LAYERS = [3, LAST_LAYER]


# --- served builders ----------------------------------------------------------------------------------


def tiny_target(kind: str = "qwen3", **overrides) -> PreTrainedModel:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**{**TINY_TARGETS[kind], **overrides}))


def sharpened_target(kind: str = "qwen3") -> PreTrainedModel:
    """A tiny random target whose LM head is scaled up, so its greedy choices are far from ties."""
    model = tiny_target(kind, eos_token_id=EOS)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(10)
    return model


def make(module_class: type[DFlashModule], target, **kwargs) -> DFlashModule:
    torch.manual_seed(0)
    sizes = DFLASH2_SIZES if module_class is DFlash2Module else {}
    return module_class(
        target,
        mask_token_id=MASK,
        num_draft_layers=kwargs.pop("num_draft_layers", 2),
        block_size=BLOCK,
        num_anchors=4,
        draft_attn_backend="sdpa",
        target_attn_backend="sdpa",
        **{**sizes, **kwargs},
    )


def training_batch() -> dict[str, torch.Tensor]:
    docs = random_docs([9, 7], vocab=MASK, seed=7) + random_docs([12], vocab=MASK, seed=8)
    return stack_rows([packed_row(docs[:2], 16), packed_row(docs[2:], 16)])


def trained_module(module_class: type[DFlashModule], steps: int = 4, target=None) -> DFlashModule:
    """A draft trained a few optimizer steps on a fixed batch (export, not quality, is under test)."""
    target = sharpened_target() if target is None else target
    module = make(module_class, target, target_layer_ids=TRAINED_LAYERS)
    batch = training_batch()
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        module.compute_loss(batch).loss.backward()
        optimizer.step()
    return module


def repeating_target() -> PreTrainedModel:
    """A tiny Qwen3 (every layer random) whose greedy output repeats its last token, with a null mask row.

    Its embeddings are scaled up until they dominate the residual stream, and its LM head is the
    row-normalised embedding, so the final hidden state at a token is closest to that token's own row.
    The reserved mask token's embedding (and LM-head) row is zero, as an unused row may be.
    """
    model = tiny_target()
    with torch.no_grad():
        embedding = model.get_input_embeddings().weight.mul_(50)
        embedding[MASK] = 0
        norms = embedding.norm(dim=-1, keepdim=True).clamp(min=1e-6)
        model.get_output_embeddings().weight.copy_(10 * embedding / norms)
    return model


def perfect_module(module_class: type[DFlashModule]) -> DFlashModule:
    """A one-layer DFlash / DFlash2 draft that predicts, at every masked slot, what the target predicts.

    Construction (target: :func:`repeating_target`; prompts: one token repeated, so every context position
    carries the same target features ``f(a)`` and the target's greedy continuation is ``a a a ...``):

    * ``fc`` selects the chunk of ``target_layer_ids[1]``, the target's **last** layer, whose output the
      target's final norm and LM head turn into its greedy token ``a``; ``v_proj`` / ``o_proj`` are the
      identity (4 KV heads, so values are not squeezed through GQA);
    * ``k_norm`` is zero, so every key is 0 and attention is uniform: each slot averages the context values
      (all ``hidden_norm(f(a))``), the anchor slot's value (its embedding, along ``a``'s row) and the mask
      slots' values, which are zero because the mask token's embedding row is zero;
    * ``post_attention_layernorm`` is zero, so the MLP adds nothing; ``norm`` is the target's final norm.

    So every masked slot's logits are the target's own logits of ``a``: a draft served with the right
    mask token proposes ``a`` at every slot and reaches ``block_size``. DFlash2's convs and selector are
    moved off their (identity / zero) init but kept small, so they carry the same picks.
    """
    target = repeating_target()
    module = make(
        module_class,
        target,
        num_draft_layers=1,
        target_layer_ids=[3, LAST_LAYER],
        draft_overrides={"num_key_value_heads": 4},
    )
    draft, hidden = module.draft, module.draft.fc.weight.shape[0]
    layer = draft.layers[0]
    with torch.no_grad():
        draft.fc.weight.zero_()
        draft.fc.weight[:, hidden:] = torch.eye(hidden)
        layer.self_attn.k_norm.weight.zero_()
        layer.self_attn.v_proj.weight.copy_(torch.eye(hidden))
        layer.self_attn.o_proj.weight.copy_(torch.eye(hidden))
        layer.post_attention_layernorm.weight.zero_()
        draft.norm.weight.copy_(target.model.norm.weight)
        if module_class is DFlash2Module:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel[:, 1:] = 0.1
                conv.kernel_projection.weight.normal_(std=1e-3)
            draft.candidate_selector.successor_codebook.normal_(std=1e-2)
    return module


def repeated_prompts() -> list[torch.Tensor]:
    return [torch.full((length,), token) for length, token in ((5, 3), (7, 11), (9, 40))]


# --- conformance --------------------------------------------------------------------------------------


def build(module_class: type[DFlashModule], target, **options) -> DFlashModule:
    options = {
        "mask_token_id": MASK_TOKEN,
        "num_draft_layers": 2,
        "block_size": BLOCK,
        "num_anchors": 3,
        **options,
    }
    if module_class is DFlash2Module:
        # Enough candidates that some gold tokens are among them, so the selector's codebooks get gradients.
        options = {"selector_rank": 8, "selector_top_k": 32, **options}
    module = module_class(target, **options)
    perturb(module)  # convs off the identity, the selector's successor codebook off zero
    return module


def _case(module_class: type[DFlashModule], quickstart: str, **fields) -> FamilyCase:
    return FamilyCase(
        module_class=module_class,
        targets=("qwen3", "llama", "deepseek_v3"),
        build=lambda target, **options: build(module_class, target, **options),
        trained=lambda kind: trained_module(module_class, target=sharpened_target(kind)),
        num_steps=lambda module: module.block_size - 1,
        quickstart=ROOT / "configs" / "quickstart" / quickstart,
        required_tensor="fc.weight",
        vocab=MASK,
        loss_inputs=anchor_inputs,
        padded_inputs=padded_anchor_inputs,
        takes_anchors=True,
        config_of=lambda module: module.dflash_config(),
        details={"mask_token_id": MASK, "block_size": BLOCK},
        **fields,
    )


CASES = {
    DFlashModule: _case(
        DFlashModule,
        "dflash.yaml",
        variants={
            "plain": {},
            "window+variable_prefix": {
                "sliding_window": 3,
                "variable_prefix": True,
                "loss_decay_gamma": None,
            },
        },
    ),
    DFlash2Module: _case(DFlash2Module, "dflash2.yaml"),
}
