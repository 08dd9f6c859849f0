"""DSparkModule: blocks and the eval mask by hand, the Markov and confidence heads, the three-term
objective, guards, zero-anchor batches, and a few steps in a Lightning Trainer (packed == padded, document
isolation, bad batches and anchors, the export round trip: tests/families/test_conformance.py)."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_drafts import DSparkModule
from lightning_drafts.attention.block_masks import block_layout
from lightning_drafts.core.batch import validate_batch
from lightning_drafts.core.ratio_metric import ratio
from lightning_drafts.core.row_blocks import ROWS as ROW_BLOCK
from lightning_drafts.dspark.confidence_head import ConfidenceHead
from lightning_drafts.dspark.context_features import (
    context_features,
    default_target_layer_ids,
    hooked_layer_ids,
)
from lightning_drafts.dspark.eval_mask import block_supervision, build_eval_mask
from lightning_drafts.dspark.markov_head import MarkovHead
from lightning_drafts.dspark.metrics import acceptance_sums
from lightning_drafts.dspark.objective import acceptance_probability, distribution_terms
from tests.support.block_draft_cases import (
    BLOCK,
    MASK_TOKEN,
    ROWS,
    assert_same_results,
    documents,
    perturb,
    run,
    twins,
    with_prompts,
)
from tests.support.builders import TINY_TARGETS, packed_row, stack_rows
from tests.support.largest_gather import LargestGather

T, F = True, False
LAYERS = [1, 4, 6]  # inside [0, L - 2]: servable by SGLang, so no warning


def make(**kwargs) -> DSparkModule:
    kwargs.setdefault("mask_token_id", MASK_TOKEN)
    kwargs.setdefault("num_draft_layers", 2)
    kwargs.setdefault("block_size", BLOCK)
    kwargs.setdefault("num_anchors", 3)
    kwargs.setdefault("markov_rank", 8)
    kwargs.setdefault("target_layer_ids", LAYERS)
    return DSparkModule(TINY_TARGETS["qwen3"], **kwargs)


def fixed_anchors(module: DSparkModule, batch: dict, seed: int = 0) -> torch.Tensor:
    return module.sample_anchors(batch, generator=torch.Generator().manual_seed(seed))


# --- blocks ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"markov_head_type": "rnn", "loss_decay_gamma": None, "logits_chunk_blocks": 4},
        {"markov_head_type": "gated", "confidence_head_with_markov": False, "target_layer_ids": [-1, 3, 7]},
    ],
    ids=["vanilla", "rnn+uniform+chunked", "gated+embedding-feature"],
)
def test_one_block_per_anchor_slot_zero_always_supervised_and_holes_cut_blocks(options):
    # Packed == padded under these options (loss, gradients, statistics) is the conformance suite's.
    module = make(**options)
    perturb(module)
    packed_batch, _ = twins(ROWS, width=20)
    anchors = fixed_anchors(module, packed_batch)
    with torch.no_grad():
        output = module.compute_loss(packed_batch, anchors=anchors)
    assert output.correct.shape == (int((anchors >= 0).sum()), BLOCK)
    assert output.valid[:, 0].all() and not output.valid.all()


def test_a_block_crossing_into_the_next_document_is_cut_at_its_end():
    # That the next document's tokens then leave the block's outputs unchanged is the conformance suite's.
    module = make()
    before, after = documents([9, 8], seed=5)
    target_doc = documents([12], seed=6)[0]
    batch = with_prompts(packed_row([before, target_doc, after], 40))
    # Middle document = row positions 9..20; the block at 19 crosses into the next document.
    output = module.compute_loss(batch, anchors=torch.tensor([[11, 16, 19]]))
    assert output.valid[2].tolist() == [T, F, F, F]
    assert output.valid[:2].all()


# --- the eval mask, by hand -----------------------------------------------------------------------


def test_eval_mask_truncates_at_document_boundaries_by_hand():
    # Two documents of 4 in one row, all supervised: doc_remaining = 3 2 1 0 | 3 2 1 0.
    loss_mask = torch.ones(1, 8, dtype=torch.bool)
    remaining = torch.tensor([[3, 2, 1, 0, 3, 2, 1, 0]])
    mask = build_eval_mask(
        loss_mask, remaining, torch.zeros(4, dtype=torch.long), torch.tensor([0, 2, 3, 5]), 4
    )
    expected = torch.tensor([[T, T, T, F], [T, F, F, F], [F, F, F, F], [T, T, F, F]])
    assert torch.equal(mask, expected)

    # The document term matters on its own: the next document is supervised, yet anchor 3 stops at 4.
    loss_mask = torch.tensor([[F, T, T, T, T, T, T, T, T, T]])
    remaining = torch.tensor([[4, 3, 2, 1, 0, 4, 3, 2, 1, 0]])
    mask = build_eval_mask(loss_mask, remaining, torch.tensor([0]), torch.tensor([3]), 4)
    assert mask.tolist() == [[T, F, F, F]]

    # A hole in loss_mask ends the block even where later slots are supervised again (cumprod).
    loss_mask = torch.tensor([[T, T, F, T, T, T]])
    remaining = torch.tensor([[5, 4, 3, 2, 1, 0]])
    mask = build_eval_mask(loss_mask, remaining, torch.tensor([0, 0]), torch.tensor([0, 3]), 4)
    assert mask.tolist() == [[T, F, F, F], [T, T, F, F]]  # the second block ends at the row end

    # Padding: a document of 4 in a row of 6.
    loss_mask = torch.tensor([[T, T, T, T, F, F]])
    remaining = torch.tensor([[3, 2, 1, 0, 0, 0]])
    mask = build_eval_mask(loss_mask, remaining, torch.tensor([0]), torch.tensor([1]), 4)
    assert mask.tolist() == [[T, T, F, F]]


def test_block_supervision_shifts_labels_by_one_by_hand():
    ids = torch.arange(10, 20)
    batch = packed_row([ids[:5], ids[5:]], 10)
    packed = validate_batch(batch)
    layout = block_layout(packed, torch.tensor([[3, 6, 8]]), 4)
    supervision = block_supervision(packed, layout)
    assert supervision.labels.tolist() == [[14, 15, 16, 17], [17, 18, 19, 19], [19, 19, 19, 19]]
    assert supervision.previous.tolist() == [[13, 14, 15, 16], [16, 17, 18, 19], [18, 19, 19, 19]]
    assert supervision.teacher_positions.tolist() == [[3, 4, 5, 6], [6, 7, 8, 9], [8, 9, 9, 9]]
    assert supervision.valid.tolist() == [[T, F, F, F], [T, T, T, F], [T, F, F, F]]


def test_anchors_keep_partial_in_document_blocks():
    # Documents of 2 and 3 tokens, all supervised, block size 4: a valid anchor needs the next token in
    # its document, so 0 (doc 0) and 2, 3 (doc 1); documents shorter than a block still train.
    module = make(num_anchors=10)
    batch = packed_row(documents([2, 3]), 6)
    assert module.sample_anchors(batch).tolist() == [[0, 2, 3]]
    output = module.compute_loss(batch)
    assert output.valid.tolist() == [[T, F, F, F], [T, T, F, F], [T, F, F, F]]
    # Per-document budget: one anchor per document.
    assert (make(num_anchors=1).sample_anchors(batch) >= 0).sum() == 2


# --- heads ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
def test_markov_head_shapes_gradients_and_causality(head_type):
    torch.manual_seed(0)
    head = MarkovHead(vocab_size=11, hidden_size=6, rank=3, head_type=head_type)
    previous = torch.randint(0, 11, (2, 4))
    hidden = torch.randn(2, 4, 6, requires_grad=True)
    embedded = head.embed(previous)
    bias = head(embedded, hidden)
    assert embedded.shape == (2, 4, 3) and bias.shape == (2, 4, 11)
    bias.square().sum().backward()
    assert all(p.grad is not None and p.grad.any() for p in head.parameters())
    if head_type == "vanilla":
        expected = head.markov_w1.weight[previous] @ head.markov_w2.weight.T
        torch.testing.assert_close(bias, expected)
        assert hidden.grad is None  # a bigram table reads no hidden state
    # Slot k's bias depends on slots <= k only: changing the last previous token leaves the rest.
    changed = previous.clone()
    changed[:, 3] = (changed[:, 3] + 1) % 11
    other = head(head.embed(changed), hidden)
    torch.testing.assert_close(other[:, :3], bias[:, :3])
    assert not torch.allclose(other[:, 3], bias[:, 3])


def test_markov_bias_added_in_one_product_equals_the_formula():
    """Flat logits take the fused product-and-add: ``logits + W2 e`` written out, and its gradients."""
    torch.manual_seed(0)
    head = MarkovHead(vocab_size=11, hidden_size=6, rank=3)
    logits = torch.randn(5, 11, requires_grad=True)
    latents = torch.randn(5, 3, requires_grad=True)
    fused = head.add_bias(logits * 1.0, latents)
    expected = logits + latents @ head.markov_w2.weight.T
    torch.testing.assert_close(fused, expected)
    probe = torch.randn(5, 11)
    grads = torch.autograd.grad((fused * probe).sum(), (logits, latents, head.markov_w2.weight))
    wanted = torch.autograd.grad((expected * probe).sum(), (logits, latents, head.markov_w2.weight))
    for got, want in zip(grads, wanted, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_vanilla_markov_bias_projects_each_previous_token_once_and_equals_the_formula(dtype):
    """Given the previous tokens, a bigram row is projected once per distinct token and added to every slot
    that follows it: ``logits + W2 W1[previous]`` written out, and its gradients."""
    torch.manual_seed(0)
    head = MarkovHead(vocab_size=11, hidden_size=6, rank=3)
    logits = torch.randn(7, 11, requires_grad=True)
    previous = torch.tensor([4, 9, 4, 0, 9, 4, 2])
    rows = []
    hook = head.markov_w2.register_forward_hook(lambda module, args, out: rows.append(args[0].shape[0]))
    fused = head.add_bias(logits.to(dtype) * 1.0, head.embed(previous), previous)
    hook.remove()
    assert rows == [4] and fused.dtype == dtype
    expected = logits.to(dtype) + (head.markov_w1.weight[previous] @ head.markov_w2.weight.T).to(dtype)
    torch.testing.assert_close(fused, expected)
    probe = torch.randn(7, 11)
    weights = (logits, head.markov_w1.weight, head.markov_w2.weight)
    grads = torch.autograd.grad((fused.float() * probe).sum(), weights)
    wanted = torch.autograd.grad((expected.float() * probe).sum(), weights)
    for got, want in zip(grads, wanted, strict=True):
        torch.testing.assert_close(got, want)


def test_a_vanilla_markov_bias_over_blocks_of_slots_copies_no_logits():
    """``[M, K, V]`` logits take the bias in place, forward and backward, with no copy of them."""
    torch.manual_seed(1)
    head = MarkovHead(vocab_size=11, hidden_size=6, rank=3)
    logits = torch.randn(3, 5, 11, requires_grad=True)
    previous = torch.randint(0, 11, (3, 5))
    gather = LargestGather()
    with gather:
        fused = head.add_bias(logits * 1.0, head.embed(previous), previous)
        fused.sum().backward()
    expected = logits + head.markov_w1.weight[previous] @ head.markov_w2.weight.T
    torch.testing.assert_close(fused, expected)
    assert fused.shape == (3, 5, 11) and gather.clones == 0


def test_a_step_projects_the_markov_bias_once_per_distinct_previous_token():
    module = make()
    packed_batch, _ = twins(ROWS, width=20)
    anchors = fixed_anchors(module, packed_batch)
    supervision = block_supervision(
        validate_batch(packed_batch), block_layout(validate_batch(packed_batch), anchors, BLOCK)
    )
    distinct = supervision.previous[supervision.valid].unique().numel()
    rows = []
    hook = module.draft.markov_head.markov_w2.register_forward_hook(
        lambda mod, args, out: rows.append(args[0].shape[0])
    )
    module.compute_loss(packed_batch, anchors=anchors).loss.backward()
    hook.remove()
    assert rows == [distinct] and distinct < int(supervision.valid.sum())


def test_confidence_head_shapes_and_gradients():
    head = ConfidenceHead(6 + 3)
    hidden = torch.randn(2, 4, 6, requires_grad=True)
    embedded = torch.randn(2, 4, 3, requires_grad=True)
    logits = head(hidden, embedded)
    assert logits.shape == (2, 4) and logits.dtype == torch.float32
    logits.sum().backward()
    assert head.proj.weight.grad.any() and head.proj.bias.grad.any()
    assert hidden.grad.any() and embedded.grad.any()  # features are not detached
    assert head.proj.weight.shape == (1, 9)


def test_confidence_loss_trains_backbone_and_markov_embedding_only():
    module = make(ce_loss_alpha=0.0, l1_loss_alpha=0.0)
    batch, _ = twins(ROWS, width=20)
    module.compute_loss(batch, anchors=fixed_anchors(module, batch)).loss.backward()
    draft = module.draft
    for trained in (draft.confidence_head.proj.weight, draft.markov_head.markov_w1.weight, draft.fc.weight):
        assert trained.grad is not None and trained.grad.any()
    # Its target alpha is detached, so nothing reaches the Markov output projection through it.
    assert (
        draft.markov_head.markov_w2.weight.grad is None or not draft.markov_head.markov_w2.weight.grad.any()
    )
    assert draft.embed_tokens.weight.grad is None and draft.lm_head.weight.grad is None  # frozen copies


def test_frozen_copies_equal_the_target_and_unfreeze_on_request():
    module = make()
    assert torch.equal(module.draft.embed_tokens.weight, module.target.input_embeddings.weight)
    assert torch.equal(module.draft.lm_head.weight, module.target.lm_head.weight)
    trainable = {n for n, p in module.draft.named_parameters() if p.requires_grad}
    assert "embed_tokens.weight" not in trainable and "lm_head.weight" not in trainable
    assert {"fc.weight", "markov_head.markov_w2.weight", "confidence_head.proj.bias"} <= trainable
    unfrozen = make(freeze_embeddings=False)
    assert unfrozen.draft.embed_tokens.weight.requires_grad and unfrozen.draft.lm_head.weight.requires_grad


def test_no_markov_head_and_no_confidence_head():
    module = make(markov_rank=0, confidence_head_alpha=0.0)
    assert module.draft.markov_head is None and module.draft.confidence_head is None
    batch, _ = twins(ROWS, width=20)
    output = module.compute_loss(batch, anchors=fixed_anchors(module, batch))
    assert torch.isfinite(output.loss) and "confidence_bias" not in output.metrics
    assert float(output.metrics["confidence_loss"]) == 0.0


# --- the objective --------------------------------------------------------------------------------


def test_distribution_terms_and_acceptance_by_hand():
    draft = torch.tensor([[0.0, 0.0]])  # p = (1/2, 1/2)
    teacher = torch.tensor([[math.log(3.0), 0.0]])  # q = (3/4, 1/4)
    ce, l1, predicted = distribution_terms(draft, teacher, torch.tensor([0]))
    assert predicted.tolist() == [0]  # a tie: the first maximal id, as argmax
    torch.testing.assert_close(ce, torch.tensor([math.log(2.0)]))
    torch.testing.assert_close(l1, torch.tensor([0.5]))
    torch.testing.assert_close(acceptance_probability(l1), torch.tensor([0.75]))
    _, same, _ = distribution_terms(teacher, teacher, torch.tensor([0]))
    assert float(same) < 1e-6 and float(acceptance_probability(same)) == pytest.approx(1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_distribution_terms_gradient_is_the_formulas_gradient(dtype):
    """The written-out gradient equals autograd's through the two formulas (log-softmax CE, L1 of the
    softmax difference), for both terms in any mix, at slots close to their teacher and far from it, and in
    bf16 (gradient returned in the logits' dtype)."""
    gen = torch.Generator().manual_seed(3)
    teacher = torch.randn(2, 5, 40, generator=gen)
    logits = torch.randn(2, 5, 40, generator=gen)
    logits[1] = teacher[1] + 0.1 * logits[1]
    logits = logits.to(dtype)
    labels = torch.randint(0, 40, (2, 5), generator=gen)
    w_ce, w_l1 = torch.rand(2, 5, generator=gen), torch.rand(2, 5, generator=gen)

    def formulas(z):
        log_probs = torch.log_softmax(z.float(), dim=-1)
        ce = -log_probs.gather(-1, labels[..., None]).squeeze(-1)
        return ce, (log_probs.exp() - torch.softmax(teacher, dim=-1)).abs().sum(-1)

    results = []
    for terms in (
        formulas,
        lambda z: distribution_terms(z, teacher, labels)[:2],
        # Handed over: the softmaxes are written into a non-leaf copy of the logits and a teacher copy.
        lambda z: distribution_terms(z.flatten(0, 1) * 1, teacher.clone(), labels, consume=True)[:2],
    ):
        z = logits.clone().requires_grad_(True)
        ce, l1 = terms(z)
        ((ce * w_ce).sum() + (l1 * w_l1).sum()).backward()
        results.append((ce.detach(), l1.detach(), z.grad))
    (ce, l1, grad), *fast = results
    for fast_ce, fast_l1, fast_grad in fast:
        torch.testing.assert_close(fast_ce, ce, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fast_l1, l1, rtol=1e-5, atol=1e-5)
        assert fast_grad.dtype == dtype
        tolerance = 1e-6 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(fast_grad.float(), grad.float(), rtol=tolerance, atol=tolerance)
    for one, consumed in zip(fast[0], fast[1], strict=True):
        torch.testing.assert_close(consumed, one, rtol=0, atol=0)


def test_consumed_logits_hold_the_softmaxes_and_no_second_copy_is_saved():
    """``consume=True``: the draft and teacher softmaxes are written into the logits handed over, and what
    backward keeps is that storage, not a second ``[n, V]`` tensor; without it the logits stay as they were."""
    gen = torch.Generator().manual_seed(4)
    logits, teacher = torch.randn(6, 50, generator=gen), torch.randn(3, 50, generator=gen)
    labels, index = torch.randint(0, 50, (6,), generator=gen), torch.tensor([0, 1, 1, 2, 2, 0])
    saved: list[torch.Tensor] = []
    for consume in (False, True):
        z = logits.clone().requires_grad_(True)
        draft, given_teacher = z * 1, teacher.clone()
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            ce, l1, _ = distribution_terms(draft, given_teacher, labels, index, consume=consume)
        vocabulary_wide = {t.data_ptr() for t in saved if t.shape[-1] == 50 and t.dim() == 2}
        if consume:
            torch.testing.assert_close(draft.detach(), torch.softmax(logits, -1), rtol=0, atol=0)
            torch.testing.assert_close(given_teacher, torch.softmax(teacher, -1), rtol=0, atol=0)
            assert vocabulary_wide == {draft.data_ptr(), given_teacher.data_ptr()}
        else:
            assert torch.equal(draft.detach(), logits) and torch.equal(given_teacher, teacher)
            assert not vocabulary_wide & {draft.data_ptr(), given_teacher.data_ptr()}
        (ce.sum() + l1.sum()).backward()
        assert torch.isfinite(z.grad).all()


def test_distribution_terms_with_shared_teacher_rows_equal_one_row_per_slot():
    """Slots that share a teacher position, given its logits once and an index, get the terms, argmax
    and gradient of the one-row-per-slot call; backward runs once (its buffers are reused)."""
    gen = torch.Generator().manual_seed(5)
    distinct = torch.randn(3, 30, generator=gen)
    index = torch.tensor([0, 1, 1, 2, 0, 2, 2])
    logits = torch.randn(7, 30, generator=gen)
    logits[2, 4] = logits[2, 9] = logits[2].max() + 1.0  # a tied maximum
    labels = torch.randint(0, 30, (7,), generator=gen)
    results = []
    for teacher, teacher_index in ((distinct[index], None), (distinct, index)):
        z = logits.clone().requires_grad_(True)
        ce, l1, predicted = distribution_terms(z, teacher, labels, teacher_index)
        (ce.sum() + 0.5 * l1.sum()).backward(retain_graph=True)
        results.append((ce.detach(), l1.detach(), predicted, z.grad))
        with pytest.raises(RuntimeError, match="backward ran twice"):
            (ce.sum() + l1.sum()).backward()
    for one, shared in zip(*results, strict=True):
        torch.testing.assert_close(shared, one, rtol=0, atol=0)
    assert torch.equal(results[0][2], logits.argmax(-1)) and int(results[0][2][2]) == 4


def test_shared_teacher_rows_are_gathered_a_block_at_a_time():
    """Forward and backward read each slot's teacher row in blocks of rows, never as an ``[n, V]`` copy."""
    gen = torch.Generator().manual_seed(6)
    n, vocab = 3 * ROW_BLOCK + 2, 30
    z = torch.randn(n, vocab, generator=gen, requires_grad=True)
    teacher, index = torch.randn(5, vocab, generator=gen), torch.randint(0, 5, (n,), generator=gen)
    gather = LargestGather()
    with gather:
        ce, l1, _ = distribution_terms(z * 1, teacher, torch.randint(0, vocab, (n,), generator=gen), index)
        (ce.sum() + l1.sum()).backward()
    assert gather.largest == ROW_BLOCK * vocab and z.grad.abs().sum() > 0


def test_acceptance_sums_by_hand():
    alpha = torch.tensor([[0.5, 0.8, 0.9], [1.0, 0.5, 0.2]])
    valid = torch.tensor([[T, T, F], [T, F, F]])
    sums = acceptance_sums(alpha, valid)
    values = {name: float(ratio(*pair)) for name, pair in sums.items()}
    assert values["accept_rate_k0"] == pytest.approx(0.75)
    assert values["accept_rate_k1"] == pytest.approx(0.8)
    assert values["accept_rate_k2"] == 0.0 and float(sums["accept_rate_k2"][1]) == 0.0
    assert values["accept_rate"] == pytest.approx(2.3 / 3)
    assert values["tau"] == pytest.approx((1.9 + 2.0) / 2)  # 1 + .5 + .5 * .8 and 1 + 1


def test_loss_is_the_weighted_sum_of_its_terms_with_decayed_slots():
    module = make(ce_loss_alpha=0.3, l1_loss_alpha=0.5, confidence_head_alpha=2.0, loss_decay_gamma=2.0)
    batch, _ = twins(ROWS, width=20)
    output = module.compute_loss(batch, anchors=fixed_anchors(module, batch))
    terms = output.metrics
    expected = 0.3 * terms["ce_loss"] + 0.5 * terms["tv_loss"] + 2.0 * terms["confidence_loss"]
    torch.testing.assert_close(output.loss, expected)
    assert 0.0 <= float(terms["tv_loss"]) <= 2.0 and 1.0 <= float(terms["tau"]) <= BLOCK + 1
    # Decay: the ce term with gamma = 2 differs from the uniform one on the same anchors.
    uniform = make(ce_loss_alpha=0.3, l1_loss_alpha=0.5, confidence_head_alpha=2.0, loss_decay_gamma=None)
    assert not torch.allclose(
        uniform.compute_loss(batch, anchors=fixed_anchors(module, batch)).metrics["ce_loss"], terms["ce_loss"]
    )


def test_distributed_normalisation_uses_the_global_weight_sum(monkeypatch):
    module = make()
    batch, _ = twins(ROWS, width=20)
    anchors = fixed_anchors(module, batch)
    local = module.compute_loss(batch, anchors=anchors).loss.detach()
    from lightning_drafts.dspark import objective

    calls = []

    def all_reduce(tensor, op=None):
        calls.append(float(tensor))
        tensor.mul_(3.0)  # the other rank supervised twice as much

    monkeypatch.setattr(objective.dist, "is_available", lambda: True)
    monkeypatch.setattr(objective.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(objective.dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(objective.dist, "all_reduce", all_reduce)
    scaled = module.compute_loss(batch, anchors=anchors).loss
    torch.testing.assert_close(scaled, local * 2.0 / 3.0, rtol=1e-5, atol=1e-7)
    assert len(calls) == 1
    with torch.no_grad():  # validation stays local: no collective
        torch.testing.assert_close(module.compute_loss(batch, anchors=anchors).loss, local)
    assert len(calls) == 1


def test_loss_decreases_on_a_fixed_batch():
    module = make()
    batch, _ = twins(ROWS, width=20)
    anchors = fixed_anchors(module, batch)
    optimizer = torch.optim.Adam([p for p in module.draft.parameters() if p.requires_grad], lr=1e-2)
    outputs = []
    for _ in range(8):
        optimizer.zero_grad()
        output = module.compute_loss(batch, anchors=anchors)
        output.loss.backward()
        optimizer.step()
        outputs.append(output)
    first, last = outputs[0], outputs[-1]
    assert last.loss < 0.8 * first.loss
    assert last.metrics["ce_loss"] < first.metrics["ce_loss"]  # not only the confidence head learns


@pytest.mark.parametrize("freeze_embeddings", [True, False], ids=["frozen-head", "trained-head-copy"])
def test_chunked_logits_equal_one_piece(freeze_embeddings: bool):
    batch, _ = twins(ROWS, width=20)
    results = []
    for chunk in (None, 2):
        module = make(logits_chunk_blocks=chunk, freeze_embeddings=freeze_embeddings)
        perturb(module)
        results.append(run(module, batch, fixed_anchors(module, batch, seed=4)))
    assert_same_results(*results)


def test_flex_block_mask_path_matches_sdpa_on_cpu():
    # Flex has no CPU backward, so the BlockMask path is checked forward-only here.
    batch, _ = twins(ROWS[:2], width=20)
    outputs = []
    for backend in ("sdpa", "flex"):
        module = make(draft_attn_backend=backend)
        perturb(module)
        with torch.no_grad():
            outputs.append(module.compute_loss(batch, anchors=fixed_anchors(module, batch, seed=3)))
    torch.testing.assert_close(outputs[1].loss, outputs[0].loss, rtol=1e-5, atol=1e-6)
    assert torch.equal(outputs[1].correct, outputs[0].correct)


# --- target features, defaults, precision ---------------------------------------------------------


def test_context_features_follow_the_hf_offset_one_convention():
    module = make(target_layer_ids=[-1, 2, 7])
    batch = packed_row(documents([12]), 12)
    packed = validate_batch(batch)
    output = module.target_output(packed, hooked_layer_ids([-1, 2, 7], module.target.num_layers))
    features, final = context_features(output, module.target, packed, [-1, 2, 7]), output.last_hidden_state
    with torch.no_grad():
        reference = module.target.model(
            input_ids=batch["input_ids"], output_hidden_states=True, use_cache=False
        )
    states = reference.hidden_states
    torch.testing.assert_close(features, torch.cat([states[0], states[3], states[8]], dim=-1))
    torch.testing.assert_close(final, states[8])  # L - 1 is the final-norm output


def test_default_target_layer_ids_and_the_sglang_warning():
    assert default_target_layer_ids(28, 5) == [1, 8, 14, 20, 27]
    assert default_target_layer_ids(36, 5) == [1, 10, 18, 26, 35]
    assert default_target_layer_ids(8, 1) == [7]
    assert default_target_layer_ids(8, 20) == sorted(set(default_target_layer_ids(8, 7)))
    with pytest.warns(UserWarning, match="SGLang"):
        module = make(target_layer_ids=None)
    assert module.target_layer_ids == [1, 7]


def test_rope_inverse_frequencies_stay_fp32_through_dtype_casts():
    module = make()
    reference = module.draft.rotary_emb.inv_freq.clone()
    module.to(torch.bfloat16).to(torch.float16)
    assert module.draft.fc.weight.dtype == torch.float16
    assert module.draft.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(module.draft.rotary_emb.inv_freq, reference)


# --- guards and edge cases ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mask_token_id": None}, "mask_token_id is required"),
        ({"mask_token_id": 96}, r"outside the target vocabulary \[0, 96\)"),
        ({"block_size": 0}, "block_size = 0"),
        ({"num_anchors": 0}, "num_anchors = 0"),
        ({"num_draft_layers": 0}, "num_draft_layers = 0"),
        ({"markov_rank": -1}, "markov_rank = -1"),
        ({"markov_head_type": "lstm"}, "markov_head_type = 'lstm'"),
        ({"ce_loss_alpha": -0.1}, "ce_loss_alpha = -0.1"),
        ({"ce_loss_alpha": 0.0, "l1_loss_alpha": 0.0, "confidence_head_alpha": 0.0}, "nothing would train"),
        ({"markov_rank": 0}, "confidence_head_with_markov = true but markov_rank is 0"),
        ({"loss_decay_gamma": 0.0}, "loss_decay_gamma = 0.0"),
        ({"draft_attn_backend": "flash"}, "draft_attn_backend 'flash'"),
        ({"mask_token_id": 5, "pad_token_id": 5}, "mask_token_id = 5, the tokenizer's pad_token_id"),
        ({"logits_chunk_blocks": 0}, "logits_chunk_blocks = 0"),
        ({"target_layer_ids": [1, 8]}, r"offending: \[8\]"),
        ({"target_layer_ids": [-2, 3]}, r"offending: \[-2\]"),
        ({"target_layer_ids": [4, 1]}, "strictly increasing"),
        ({"target_layer_ids": []}, "non-empty"),
        ({"draft_overrides": {"hidden_size": 64}}, "not overridable"),
    ],
)
def test_construction_guards_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make(**kwargs)


def test_vocabulary_guards_raise_value_error():
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(TINY_TARGETS["qwen3"])
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields))
    model.lm_head = torch.nn.Linear(32, 97, bias=False)  # one more output row than embedding rows
    with pytest.raises(ValueError, match="96 rows but its LM head 97"):
        DSparkModule(model, mask_token_id=MASK_TOKEN, markov_rank=8, target_layer_ids=LAYERS)
    draft = make().draft
    with pytest.raises(ValueError, match=r"expects \(96, 32\)"):
        draft.copy_target_weights(torch.zeros(95, 32), torch.zeros(96, 32))


@pytest.mark.parametrize("given", [False, True], ids=["sampled", "explicit-empty"])
def test_no_valid_anchor_gives_a_finite_connected_zero_loss(given):
    module = make()
    # Prompts of 2 on documents of 3: only each last token is supervised, so no anchor anywhere.
    batch = with_prompts(
        stack_rows([packed_row(documents([3, 3]), 6), packed_row(documents([3], seed=1), 6)])
    )
    output = module.compute_loss(batch, anchors=torch.empty(2, 0, dtype=torch.long) if given else None)
    assert output.loss.item() == 0.0 and output.loss.requires_grad
    assert output.correct.shape == (0, BLOCK) and output.valid.shape == (0, BLOCK)
    assert int(output.valid_tokens) == 0 and float(output.metrics["blocks"]) == 0.0
    assert all(torch.isfinite(v) for v in output.metrics.values())
    assert all(float(den) == 0.0 for _, den in output.sums.values())
    module.zero_grad()
    output.loss.backward()
    trainable = [p for p in module.draft.parameters() if p.requires_grad]
    assert all(p.grad is not None and not p.grad.any() for p in trainable)


# --- Lightning ------------------------------------------------------------------------------------


def test_trains_a_few_steps_in_a_lightning_trainer():
    module = make()
    rows = [twins(ROWS, width=20, seed=seed)[0] for seed in range(3)]
    before = {k: v.clone() for k, v in module.draft.state_dict().items()}
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=3,
        limit_val_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = torch.utils.data.DataLoader(rows, batch_size=None)
    trainer.fit(module, loader, loader)
    assert trainer.global_step == 3
    metrics = trainer.callback_metrics
    expected = {"train/loss", "train/accept_len", "train/acc_pos0", "train/valid_tokens", "train/tau"}
    expected |= {"train/accept_rate_k0", "train/ce_loss", "train/tv_loss", "train/confidence_abs_error"}
    # (A ratio nothing was counted for, e.g. a slot no validation block reaches, logs no value.)
    expected |= {"val/loss", "val/accept_len", "val/tau", "val/accept_rate_k0", "val/confidence_cumprod_bias"}
    assert expected <= set(metrics)
    assert torch.isfinite(metrics["train/loss"]) and 1.0 <= float(metrics["val/tau"]) <= BLOCK + 1
    changed = [k for k, v in module.draft.state_dict().items() if not torch.equal(before[k], v)]
    assert changed and not any(k in ("embed_tokens.weight", "lm_head.weight") for k in changed)


class _HeadCasts(TorchDispatchMode):
    """Counts the copies made of one weight (a dtype cast is a ``_to_copy`` of it)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.pointer, self.casts = weight.data_ptr(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and args[0].data_ptr() == self.pointer:
            self.casts += 1
        return func(*args, **(kwargs or {}))


def test_a_frozen_head_is_cast_once_per_step_under_autocast_and_gives_autocast_s_logits():
    """Autocast caches casts of trainable weights only: a frozen ``[V, H]`` head would be cast at every
    logits chunk. The step casts it once, and its chunked loss equals the one-piece step's under autocast."""
    batch, _ = twins(ROWS, width=20)
    losses = []
    for chunk in (None, 1):
        module = make(logits_chunk_blocks=chunk)
        perturb(module)
        anchors = fixed_anchors(module, batch, seed=4)
        casts = _HeadCasts(module.draft.lm_head.weight)
        with torch.autocast("cpu", dtype=torch.bfloat16), casts:
            output = module.compute_loss(batch, anchors=anchors)
        assert output.metrics["blocks"] > 2  # so chunks of one block are several
        assert casts.casts == 1
        assert int(output.valid_tokens) < 64
        losses.append(output.loss)
        hidden = torch.randn(3, module.draft.lm_head.in_features)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with module.draft.head_cast_once():
                once = module.draft.vocabulary_logits(hidden, None)
            assert torch.equal(once, module.draft.lm_head(hidden))
    # The same float32 terms summed chunk by chunk: reordering n of them moves the sum by at most about
    # n * 2**-24 of it (n: the supervised slots, under 64 here).
    supervised = 64
    torch.testing.assert_close(losses[1], losses[0], rtol=supervised * 2**-24, atol=0)
