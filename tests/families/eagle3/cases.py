"""EAGLE-3's conformance cases (dense and MLA) and the builders its served tests share."""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from lightning_drafts import Eagle3Module, MLAEagle3Module
from lightning_drafts.eagle3 import Eagle3Base
from tests.families.family_case import ROOT, FamilyCase, Tolerance
from tests.support.block_draft_cases import perturb
from tests.support.builders import TINY_TARGETS, VOCAB, packed_row, random_docs, stack_rows
from tests.support.eagle3_checks import build as build_eagle3
from tests.support.eagle3_checks import frequencies

STEPS = 3
# The last captured layer is the target's last layer, so its output is what the target's LM head reads.
PERFECT_LAYERS = [1, 3, 7]


def sharpened_target(name: str) -> PreTrainedModel:
    """A tiny random target whose LM head is scaled up, so its greedy choices are far from ties."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY_TARGETS[name]))
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(10)
    return model


def trained_module(module_class: type[Eagle3Base], name: str, steps: int = 4) -> Eagle3Base:
    """A draft trained a few optimizer steps on a fixed batch (export, not quality, is under test)."""
    torch.manual_seed(0)
    module = module_class(
        sharpened_target(name), ttt_length=STEPS, draft_vocab_size=48, token_frequencies=frequencies()
    )
    batch = stack_rows(
        [packed_row(random_docs([8, 7], seed=7), 16), packed_row(random_docs([12], seed=8), 16)]
    )
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        module.compute_loss(batch).loss.backward()
        optimizer.step()
    return module


def repeating_target(name: str) -> PreTrainedModel:
    """A real tiny target (every layer random) whose greedy output repeats its last token.

    Its embeddings are scaled up until they dominate the residual stream, and its LM head is the
    row-normalised embedding, so the final hidden state at a token is closest to that token's own row.
    """
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY_TARGETS[name]))
    with torch.no_grad():
        embedding = model.get_input_embeddings().weight.mul_(50)
        model.get_output_embeddings().weight.copy_(10 * embedding / embedding.norm(dim=-1, keepdim=True))
    return model


def perfect_module(module_class: type[Eagle3Base], name: str) -> Eagle3Base:
    """An EAGLE-3 draft that computes exactly what the target computes, from the captured features.

    ``fc`` selects the third captured chunk, the output of the target's last layer; the midlayer's two
    residual branches are zeroed, so the carried state passes through every depth unchanged; ``norm`` and
    ``lm_head`` are the target's final norm and LM-head rows of the draft vocabulary. So at every depth the
    draft's logits are the target's logits at the last verified slot, restricted to the draft vocabulary:
    for a target whose greedy output repeats its last token (:func:`repeating_target`), that is the
    target's next token at every depth. Draft ids map to target ids only through the (unsorted) ``d2t``.
    """
    target = repeating_target(name)
    torch.manual_seed(0)
    module = module_class(
        target,
        ttt_length=STEPS,
        draft_vocab_size=48,
        token_frequencies=frequencies(),
        target_layer_ids=PERFECT_LAYERS,
    )
    imitate_target(module, target)
    return module


@torch.no_grad()
def imitate_target(module: Eagle3Base, target: PreTrainedModel) -> None:
    """Make ``module``'s draft read out the target (see :func:`perfect_module`): ``fc`` selects the third
    captured chunk (the target's last layer when it is the last captured), ``norm`` and ``lm_head`` are the
    target's final norm and LM-head rows of the draft vocabulary, and both residual branches are zeroed."""
    draft, hidden = module.draft, module.draft.fc.weight.shape[0]
    draft.fc.weight.zero_()
    draft.fc.weight[:, 2 * hidden :] = torch.eye(hidden)
    draft.midlayer.self_attn.o_proj.weight.zero_()
    draft.midlayer.mlp.down_proj.weight.zero_()
    draft.norm.weight.copy_(target.model.norm.weight)
    draft.lm_head.weight.copy_(target.get_output_embeddings().weight[draft.selected_token_ids])


def perfect_prompts(module: Eagle3Base) -> list[Tensor]:
    """Random prompts ending in draft-vocabulary tokens whose draft id differs from their target id."""
    selected = module.draft.selected_token_ids
    picks = [j for j in range(selected.numel()) if int(selected[j]) != j][:3]
    prompts = random_docs([5, 7, 9], seed=3)
    for prompt, draft_id in zip(prompts, picks, strict=True):
        prompt[-1] = selected[draft_id]
    return prompts


def build(module_class: type[Eagle3Base], target, **options) -> Eagle3Base:
    # Four TTT steps: deeper chains than the served default, so every later step's diagonal is exercised.
    module = build_eagle3(module_class, target, **{"ttt_length": 4, **options})
    perturb(module)
    return module


def position_logits(module: Eagle3Base, batch: dict[str, Tensor]) -> Tensor:
    """``[B, T, K, V_d]``: every TTT step's logits at each row position."""
    return module.draft_logits(batch).movedim(0, 2)


def _case(module_class: type[Eagle3Base], targets: tuple[str, ...], quickstart: str, **fields) -> FamilyCase:
    return FamilyCase(
        module_class=module_class,
        targets=targets,
        build=lambda target, **options: build(module_class, target, **options),
        trained=lambda name: trained_module(module_class, name),
        num_steps=lambda module: module.hparams.ttt_length,
        quickstart=ROOT / "configs" / "quickstart" / quickstart,
        required_tensor="lm_head.weight",
        position_logits=position_logits,
        details={"draft_vocab_size": 48, "vocab_size": VOCAB, "ttt_length": STEPS},
        # The TTT unroll sums K steps of attention and chunked vocabulary terms.
        loss=Tolerance(rtol=1e-5, atol=1e-6),
        grads=Tolerance(rtol=1e-4, atol=1e-6),
        **fields,
    )


CASES = {
    Eagle3Module: _case(Eagle3Module, ("llama", "qwen3"), "eagle3.yaml"),
    MLAEagle3Module: _case(MLAEagle3Module, ("deepseek_v3",), "mla_eagle3.yaml"),
}
