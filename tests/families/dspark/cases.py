"""DSpark's conformance case (both export layouts) and the builders its served tests share."""

from __future__ import annotations

import torch

from lightning_drafts import DSparkModule
from tests.families.dflash.cases import (
    LAST_LAYER,
    MASK,
    repeating_target,
    sharpened_target,
    training_batch,
)
from tests.families.family_case import ROOT, FamilyCase, anchor_inputs, padded_anchor_inputs
from tests.support.block_draft_cases import BLOCK, MASK_TOKEN, perturb
from tests.support.builders import VOCAB

RANK = 8
MAX_ACCEPT = BLOCK + 1  # slot k proposes anchor + k + 1: K proposals, plus the target's bonus token
LAYOUTS = ["specforge", "nemo"]
# The last id is the target's final-norm output, so shifting the ids by one leaves the target.
TRAINED_LAYERS = [3, LAST_LAYER]
LAYERS = [1, 4, 6]  # inside [0, L - 2]: servable by SGLang, so no warning


# --- served builders ----------------------------------------------------------------------------------


def make(target, **kwargs) -> DSparkModule:
    torch.manual_seed(0)
    return DSparkModule(
        target,
        mask_token_id=MASK,
        num_draft_layers=kwargs.pop("num_draft_layers", 2),
        block_size=BLOCK,
        num_anchors=4,
        markov_rank=kwargs.pop("markov_rank", RANK),
        target_layer_ids=kwargs.pop("target_layer_ids", TRAINED_LAYERS),
        draft_attn_backend="sdpa",
        target_attn_backend="sdpa",
        **kwargs,
    )


def trained_module(steps: int = 4, target=None) -> DSparkModule:
    """A draft trained a few optimizer steps on a fixed batch (export, not quality, is under test)."""
    module = make(sharpened_target() if target is None else target)
    batch = training_batch()
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        module.compute_loss(batch).loss.backward()
        optimizer.step()
    return module


def perfect_module() -> DSparkModule:
    """A one-layer DSpark draft whose every slot, Markov head included, predicts what the target predicts.

    Construction (target: ``repeating_target`` of the DFlash tests, whose greedy output repeats its last
    token and whose mask-token embedding row is zero; prompts: one token ``a`` repeated, so every context
    position carries the same target features and the continuation is ``a a a ...``):

    * ``fc`` selects the chunk of feature ``L - 1``, the target's **final-norm output**, which the
      target's LM head turns into ``a``; ``v_proj`` / ``o_proj`` are the identity (4 KV heads);
    * ``k_norm`` is zero, so attention is uniform: every slot averages the context values (along
      ``hidden_norm(final_norm(a))``), the anchor slot's value (along ``a``'s embedding row) and the mask
      slots' values (zero: the mask token's embedding row is zero); the anchor slot also keeps its own
      embedding in the residual stream; ``post_attention_layernorm`` is zero, so the MLP adds nothing;
    * so every slot's backbone logits (through the target's LM head, a row-normalised embedding) peak
      at ``a``; the Markov head is a "repeat the previous token" bigram, ``W1 = W2 = U`` with unit rows
      ``U``, whose bias ``U U[prev]`` peaks at ``prev``; the walk's previous token is ``a`` at every slot;
    * the confidence head's bias is moved off its 0 initialisation (a confident draft).

    A draft served with the right mask token therefore proposes ``a`` at all K slots and reaches K + 1.
    """
    target = repeating_target()
    module = make(target, num_draft_layers=1, draft_overrides={"num_key_value_heads": 4})
    draft, hidden = module.draft, module.draft.fc.weight.shape[0]
    layer = draft.layers[0]
    generator = torch.Generator().manual_seed(3)
    unit_rows = torch.nn.functional.normalize(torch.randn(VOCAB, RANK, generator=generator), dim=-1)
    with torch.no_grad():
        draft.fc.weight.zero_()
        draft.fc.weight[:, hidden:] = torch.eye(hidden)
        layer.self_attn.k_norm.weight.zero_()
        layer.self_attn.v_proj.weight.copy_(torch.eye(hidden))
        layer.self_attn.o_proj.weight.copy_(torch.eye(hidden))
        layer.post_attention_layernorm.weight.zero_()
        draft.norm.weight.copy_(target.model.norm.weight)
        draft.markov_head.markov_w1.weight.copy_(unit_rows)
        draft.markov_head.markov_w2.weight.copy_(unit_rows)
        draft.confidence_head.proj.bias.fill_(3.0)
    return module


# --- conformance --------------------------------------------------------------------------------------


def build(target, **options) -> DSparkModule:
    defaults = {"mask_token_id": MASK_TOKEN, "num_draft_layers": 2, "block_size": BLOCK, "num_anchors": 3}
    module = DSparkModule(target, **{**defaults, "markov_rank": RANK, "target_layer_ids": LAYERS, **options})
    perturb(module)
    return module


CASES = {
    DSparkModule: FamilyCase(
        module_class=DSparkModule,
        targets=("qwen3", "llama", "deepseek_v3"),
        build=build,
        trained=lambda kind: trained_module(target=sharpened_target(kind)),
        num_steps=lambda module: module.block_size,
        quickstart=ROOT / "configs" / "quickstart" / "dspark.yaml",
        required_tensor="markov_head.markov_w2.weight",
        vocab=MASK,
        variants={
            "vanilla": {},
            "rnn+uniform+chunked": {
                "markov_head_type": "rnn",
                "loss_decay_gamma": None,
                "logits_chunk_blocks": 4,
            },
            "gated+embedding-feature": {
                "markov_head_type": "gated",
                "confidence_head_with_markov": False,
                "target_layer_ids": [-1, 3, 7],
            },
        },
        loss_inputs=anchor_inputs,
        padded_inputs=padded_anchor_inputs,
        takes_anchors=True,
        config_of=lambda module: module.dspark_config(),
        details={
            "mask_token_id": MASK,
            "block_size": BLOCK,
            "markov_rank": RANK,
            "sglang_capturable_layer_ids": False,  # TRAINED_LAYERS reads the final-norm output
        },
    )
}
