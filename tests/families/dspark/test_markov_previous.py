"""What DSpark's training objective feeds its Markov and confidence heads: the previous token of slot k is
the gold token at ``anchor + k`` (teacher forcing), never the slot's own label at ``anchor + k + 1``.

The loss is rebuilt here by the formula of docs/concepts/dspark.md#loss from the draft backbone's slot states
(read off the draft's output), the heads' weights and the target's own next-token logits; the previous tokens
and labels are indexed out of the row by hand. A head fed the label would see the answer: it trains a draft
that cheats in training and collapses when served, while packed == padded stays true.
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_drafts import DSparkModule
from tests.support.block_draft_cases import BLOCK, MASK_TOKEN, documents
from tests.support.builders import TINY_TARGETS, packed_row

GAMMA = 2.0
ALPHAS = {"ce_loss_alpha": 0.3, "l1_loss_alpha": 0.5, "confidence_head_alpha": 2.0}
ANCHORS = [1, 6]  # every slot of both blocks lies inside the 12-token document


def module_and_batch(head_type: str) -> tuple[DSparkModule, dict]:
    module = DSparkModule(
        TINY_TARGETS["qwen3"],
        mask_token_id=MASK_TOKEN,
        num_draft_layers=1,
        block_size=BLOCK,
        markov_rank=8,
        markov_head_type=head_type,
        target_layer_ids=[1, 4, 6],
        loss_decay_gamma=GAMMA,
        draft_attn_backend="sdpa",
        target_attn_backend="sdpa",
        **ALPHAS,
    )
    # A strong bigram table: the previous token then moves every term of the loss.
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in module.draft.markov_head.parameters():
            param.copy_(torch.randn(param.shape, generator=generator))
        module.draft.confidence_head.proj.weight.copy_(
            0.3 * torch.randn(module.draft.confidence_head.proj.weight.shape, generator=generator)
        )
    return module, packed_row(documents([12], seed=7), 12)


def formula_loss(module: DSparkModule, slot_states: torch.Tensor, ids: torch.Tensor, previous_of) -> float:
    """docs/concepts/dspark.md#loss written out: per slot k of the block at anchor a, label ``ids[a + k +
    1]``, previous token ``previous_of(a, k)``; weights ``exp(-k / gamma)``; ``sum w (a_ce ce + a_tv l1 +
    a_conf bce) / (sum w + 1e-6)``."""
    draft, head = module.draft, module.draft.markov_head
    with torch.no_grad():
        target_logits = module.target.model(input_ids=ids[None]).logits[0].float()
        numerator, weight_sum = 0.0, 0.0
        for m, a in enumerate(ANCHORS):
            state = torch.zeros(head.rank)  # the rnn head's recurrent state, zero at each block start
            for k in range(BLOCK):
                h = slot_states[m, k]
                e = head.markov_w1.weight[previous_of(a, k)]
                if head.head_type == "vanilla":
                    latent = e
                else:
                    gate, candidate, out = head.joint_proj(torch.cat([state, e, h])).chunk(3)
                    gate = torch.sigmoid(gate)
                    state = gate * state + (1 - gate) * torch.tanh(candidate)
                    latent = torch.tanh(out)
                logits = draft.lm_head.weight @ h + head.markov_w2.weight @ latent
                p = torch.softmax(logits, -1)
                q = torch.softmax(target_logits[a + k], -1)
                ce = -math.log(float(p[ids[a + k + 1]]))
                l1 = float((p - q).abs().sum())
                alpha = min(max(1.0 - l1 / 2, 0.0), 1.0)
                c = float(draft.confidence_head.proj(torch.cat([h, e])))
                sig = 1 / (1 + math.exp(-c))
                bce = -(alpha * math.log(sig) + (1 - alpha) * math.log(1 - sig))
                w = math.exp(-k / GAMMA)
                numerator += w * (
                    ALPHAS["ce_loss_alpha"] * ce
                    + ALPHAS["l1_loss_alpha"] * l1
                    + ALPHAS["confidence_head_alpha"] * bce
                )
                weight_sum += w
    return numerator / (weight_sum + 1e-6)


@pytest.mark.parametrize("head_type", ["vanilla", "rnn"])
def test_the_objective_feeds_the_heads_the_token_before_each_slot(head_type):
    module, batch = module_and_batch(head_type)
    ids = batch["input_ids"][0]
    captured = []
    hook = module.draft.register_forward_hook(lambda _module, _args, out: captured.append(out.detach()))
    try:
        loss = float(module.compute_loss(batch, anchors=torch.tensor([ANCHORS])).loss.detach())
    finally:
        hook.remove()
    (slot_states,) = captured
    assert slot_states.shape[:2] == (len(ANCHORS), BLOCK)

    true_previous = formula_loss(module, slot_states, ids, lambda a, k: ids[a + k])
    label_as_previous = formula_loss(module, slot_states, ids, lambda a, k: ids[a + k + 1])
    # The case tells the two apart by far more than round-off, and the objective is the teacher-forced one.
    assert abs(true_previous - label_as_previous) > 0.05 * true_previous
    assert loss == pytest.approx(true_previous, rel=1e-5)
