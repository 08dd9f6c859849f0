"""DFlash2Module: in-block convolution, path selector, DFlash equivalence at init, guards, the serving
layout, a few Trainer steps (packed == padded with every part active, isolation, bad batches, the export
round trip: tests/families/test_conformance.py)."""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch
from safetensors.torch import load_file

from lightning_drafts import DFlash2Module, DFlashModule
from lightning_drafts.attention.anchors import sample_anchors
from lightning_drafts.blockdraft.conv import GroupedDynamicConv
from lightning_drafts.core.acceptance import acceptance_length, prefix_counts
from lightning_drafts.core.batch import validate_batch
from lightning_drafts.dflash import load_exported_draft
from lightning_drafts.dflash.path_selector import CandidateSelector, selector_cross_entropy
from tests.support.block_draft_cases import (
    BLOCK,
    MASK_TOKEN,
    ROWS,
    assert_same_results,
    perturb,
    run,
    twins,
)
from tests.support.builders import TINY_TARGETS, VOCAB


def make(cls=DFlash2Module, **kwargs):
    kwargs.setdefault("mask_token_id", MASK_TOKEN)
    kwargs.setdefault("num_draft_layers", 2)
    kwargs.setdefault("block_size", BLOCK)
    kwargs.setdefault("num_anchors", 3)
    if cls is DFlash2Module:
        kwargs.setdefault("selector_rank", 8)
        kwargs.setdefault("selector_top_k", 5)
    return cls(TINY_TARGETS["qwen3"], **kwargs)


def fixed_anchors(batch: dict, seed: int = 0) -> torch.Tensor:
    return sample_anchors(validate_batch(batch), BLOCK, 3, generator=torch.Generator().manual_seed(seed))


# --- the in-block convolution -------------------------------------------------------------------


def test_conv_is_the_identity_at_init():
    conv = GroupedDynamicConv(32, kernel_size=2, group_size=16)
    x, y = torch.randn(5, BLOCK, 32), torch.randn(5, BLOCK, 32)
    pre, dynamic = conv.prepare(x)
    assert torch.equal(pre, x) and torch.equal(conv.finish(y, dynamic), y)


def test_conv_taps_never_cross_blocks():
    conv = GroupedDynamicConv(32, kernel_size=3, group_size=8)
    with torch.no_grad():
        for param in conv.parameters():
            param.normal_()
    blocks = torch.randn(6, BLOCK, 32)
    together, dynamic = conv.prepare(blocks)
    for m in range(6):
        alone, alone_dynamic = conv.prepare(blocks[m : m + 1])
        torch.testing.assert_close(together[m : m + 1], alone)
        torch.testing.assert_close(
            conv.finish(blocks, dynamic)[m : m + 1], conv.finish(blocks[m : m + 1], alone_dynamic)
        )


def test_conv_predecessor_tap_is_an_in_block_right_shift_with_zero_at_the_block_start():
    conv = GroupedDynamicConv(32, kernel_size=2, group_size=16)
    with torch.no_grad():
        conv.base_kernel.zero_()
        conv.base_kernel[0, 1] = 1.0  # pre-sublayer kernel: only the predecessor tap
    blocks = torch.randn(3, BLOCK, 32)
    shifted, _ = conv.prepare(blocks)
    assert not shifted[:, 0].any()
    assert torch.equal(shifted[:, 1:], blocks[:, :-1])


@pytest.mark.parametrize(
    ("kernel", "group", "match"), [(2, 5, "conv_group_size = 5"), (0, 16, "conv_kernel_size")]
)
def test_conv_guards(kernel, group, match):
    with pytest.raises(ValueError, match=match):
        GroupedDynamicConv(32, kernel, group)


# --- the path selector --------------------------------------------------------------------------


def test_greedy_walk_conditions_on_its_own_picks():
    selector = CandidateSelector(vocab_size=6, hidden_size=1, rank=1)
    with torch.no_grad():
        selector.hidden_projection.weight.fill_(1.0)
        selector.predecessor_codebook.copy_(torch.tensor([[0.0], [1.0], [-1.0], [0.0], [0.0], [0.0]]))
        selector.successor_codebook.copy_(torch.tensor([[0.0], [0.0], [0.0], [5.0], [-5.0], [0.0]]))
    hidden = torch.ones(1, 2, 1)
    candidates = torch.tensor([[[1, 2], [4, 3]]])
    unary = torch.tensor([[[1.0, 0.9], [0.1, 0.0]]])
    walk = selector.greedy_walk(hidden, unary, candidates, first=torch.tensor([0]))
    assert walk.tolist() == [[1, 3]]  # after its own pick 1, token 3 wins the pair term
    # Teacher-forced after the gold predecessor 2, the same slot picks 4 instead.
    scores = selector.scores(hidden[:, 1], unary[:, 1], candidates[:, 1], torch.tensor([2]))
    assert candidates[0, 1, scores.argmax()].item() == 4


def test_fresh_selector_ranks_exactly_like_the_logits():
    selector = CandidateSelector(vocab_size=VOCAB, hidden_size=32, rank=8)
    logits = torch.randn(4, 3, VOCAB)
    unary, candidates = logits.topk(5, dim=-1)
    scores = selector.scores(torch.randn(4, 3, 32), unary, candidates, torch.randint(0, VOCAB, (4, 3)))
    assert torch.equal(scores, unary)


def test_selector_loss_is_exactly_zero_when_no_gold_token_is_a_candidate():
    scores = torch.randn(3, 2, 4, requires_grad=True)
    candidates = torch.arange(24).view(3, 2, 4)
    labels = torch.full((3, 2), 50)
    total, weight, covered = selector_cross_entropy(scores, candidates, labels, torch.ones(3, 2))
    loss = total / (weight + 1e-6)
    assert loss.item() == 0.0 and not covered.any()
    loss.backward()
    assert torch.isfinite(scores.grad).all()


# --- the module ---------------------------------------------------------------------------------


def test_fresh_dflash2_equals_dflash_on_the_same_weights():
    dflash = make(DFlashModule)
    perturb(dflash)
    dflash2 = make(selector_loss_weight=0.0)
    convs = [m for m in dflash2.draft.modules() if isinstance(m, GroupedDynamicConv)]
    assert len(convs) == 4 and not any(conv.kernel_projection.weight.any() for conv in convs)
    missing, unexpected = dflash2.draft.load_state_dict(dflash.draft.state_dict(), strict=False)
    assert not unexpected and all("conv" in k or "candidate_selector" in k for k in missing)
    batch, _ = twins(ROWS, width=20)
    anchors = fixed_anchors(batch)

    (first, first_grads), (second, second_grads) = run(dflash, batch, anchors), run(dflash2, batch, anchors)
    # The same values, summed in another order: DFlash2's last layer also runs the slots its convolutions
    # read (with zero weight at the identity), so its products run over more rows than DFlash's.
    torch.testing.assert_close(second.loss, first.loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(second.metrics["base_loss"], first.loss, rtol=1e-6, atol=1e-7)
    assert torch.equal(second.correct, first.correct)  # the fresh selector picks the argmax
    expected_accept = acceptance_length(*prefix_counts(first.correct, first.valid)).float()
    for name in ("base_accept_len", "greedy_accept_len"):
        torch.testing.assert_close(second.metrics[name], expected_accept)
    for name, grad in first_grads.items():
        scale = max(float(grad.abs().max()), 1e-6)
        torch.testing.assert_close(second_grads[name], grad, rtol=1e-6, atol=1e-6 * scale, msg=name)


def test_loss_is_base_plus_weighted_selector_loss_and_metrics_are_consistent():
    module = make(selector_loss_weight=0.5)
    perturb(module)
    batch, _ = twins(ROWS, width=20)
    output = module.compute_loss(batch, anchors=fixed_anchors(batch))
    metrics = output.metrics
    torch.testing.assert_close(output.loss, metrics["base_loss"] + 0.5 * metrics["selector_loss"])
    accuracy = (output.correct & output.valid).sum() / output.valid.sum()
    assert accuracy <= metrics["candidate_recall"] + 1e-6
    # Teacher-forced acceptance equals the real greedy walk on the contract's prefix statistics.
    teacher_forced = acceptance_length(*prefix_counts(output.correct, output.valid)).float()
    torch.testing.assert_close(metrics["greedy_accept_len"], teacher_forced)
    assert {"candidate_recall", "greedy_accept_len", "base_accept_len", "blocks", "short_documents"} <= set(
        metrics
    )


def test_candidate_recall_is_one_when_every_token_is_a_candidate():
    module = make(selector_top_k=VOCAB)
    batch, _ = twins(ROWS[:2], width=20)
    output = module.compute_loss(batch, anchors=fixed_anchors(batch))
    assert output.metrics["candidate_recall"].item() == 1.0


def test_chunked_logits_equal_one_piece():
    batch, _ = twins(ROWS, width=20)
    anchors = fixed_anchors(batch, seed=4)
    results = []
    for chunk in (None, 2):
        module = make(logits_chunk_blocks=chunk)
        perturb(module)
        results.append(run(module, batch, anchors))
    assert_same_results(*results)


def test_selector_and_convs_get_gradients_and_leave_the_identity_after_one_step():
    module = make(selector_top_k=32)  # enough candidates that some gold tokens are covered at init
    batch, _ = twins(ROWS, width=20)
    anchors = fixed_anchors(batch)
    selector = module.draft.candidate_selector
    grads = run(module, batch, anchors)[1]
    assert grads["candidate_selector.successor_codebook"].any()
    assert not grads["candidate_selector.predecessor_codebook"].any()  # zero successor: no signal yet
    for name in ("layers.0.attention_conv.base_kernel", "layers.1.mlp_conv.kernel_projection.weight"):
        assert grads[name].any(), name
    optimizer = torch.optim.SGD(module.draft.parameters(), lr=0.1)
    optimizer.step()
    assert selector.successor_codebook.any()
    grads = run(module, batch, anchors)[1]
    assert grads["candidate_selector.predecessor_codebook"].any()
    assert grads["candidate_selector.hidden_projection.weight"].any()


def test_no_valid_anchor_gives_a_finite_connected_zero_loss():
    module = make()
    batch, _ = twins([[3, 2], [3]], width=5)
    output = module.compute_loss(batch)
    assert output.loss.item() == 0.0 and output.correct.shape == (0, BLOCK - 1)
    assert set(output.metrics) >= {"candidate_recall", "greedy_accept_len"}
    output.loss.backward()
    assert all(p.grad is not None for p in module.draft.parameters())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mask_token_id": None}, "mask_token_id is required"),
        ({"variable_prefix": True}, "variable_prefix"),
        ({"selector_top_k": VOCAB + 1}, "exceeds the vocabulary"),
        ({"selector_top_k": 0}, "selector_top_k = 0"),
        ({"selector_loss_weight": -1.0}, "selector_loss_weight"),
        ({"selector_rank": 0}, "selector_rank"),
        ({"conv_group_size": 5}, "conv_group_size = 5"),
        ({"conv_kernel_size": 0}, "conv_kernel_size"),
        ({"conv_kernel_size": BLOCK + 1}, "exceeds block_size"),
    ],
)
def test_construction_guards_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make(**kwargs)


def test_export_round_trips_with_the_dflash2_layout(tmp_path):
    module = make()
    perturb(module)
    path = module.export(tmp_path / "draft2")
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["is_causal"] is False
    assert config["dflash_config"] == {
        "block_size": BLOCK,
        "mask_token_id": MASK_TOKEN,
        "target_layer_ids": [1, 5],
        "conv_kernel_size": 2,
        "conv_group_size": 16,
        "selector_rank": 8,
        "selector_top_k": 5,
    }
    weights = load_file(str(path / "model.safetensors"))
    assert weights["layers.0.attention_conv.base_kernel"].shape == (2, 2, 32)
    assert weights["layers.1.mlp_conv.kernel_projection.weight"].shape == (2 * 2 * 2, 32)
    assert weights["candidate_selector.predecessor_codebook"].shape == (VOCAB, 8)
    assert weights["candidate_selector.successor_codebook"].shape == (VOCAB, 8)
    assert weights["candidate_selector.hidden_projection.weight"].shape == (8, 32)

    draft, _ = load_exported_draft(path)
    for name, value in module.draft.state_dict().items():
        assert torch.equal(draft.state_dict()[name], value), name
    # Reloading it into a module with its loss is the conformance suite's; a DFlash module refuses it.
    with pytest.raises(ValueError, match="DFlash2DraftModel"):
        make(DFlashModule).load_exported(path)


def test_trains_a_few_steps_in_a_lightning_trainer():
    module = make()
    rows = [twins(ROWS, width=20, seed=seed)[0] for seed in range(3)]
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=3,
        limit_val_batches=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = torch.utils.data.DataLoader(rows, batch_size=None)
    trainer.fit(module, loader, loader)
    assert trainer.global_step == 3
    metrics = trainer.callback_metrics
    assert {"train/loss", "train/accept_len", "train/candidate_recall", "train/greedy_accept_len"} <= set(
        metrics
    )
    assert torch.isfinite(metrics["train/loss"])
