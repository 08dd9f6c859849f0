"""DFlashModule: blocks and their targets, the objective, sliding window, known prefixes, guards, the
serving layout, zero-anchor batches, and a few steps in a Lightning Trainer (packed == padded, document
isolation, bad batches and anchors, the export round trip: tests/families/test_conformance.py)."""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch
from safetensors.torch import load_file

from lightning_drafts import DFlashModule
from lightning_drafts.attention.anchors import sample_anchors
from lightning_drafts.attention.block_masks import block_layout
from lightning_drafts.blockdraft.draft import default_target_layer_ids
from lightning_drafts.blockdraft.objective import LOSS_EPS, block_targets, decay_weights
from lightning_drafts.core.batch import validate_batch
from lightning_drafts.dflash import load_exported_draft
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
from tests.support.builders import TINY_TARGETS, layers_run, packed_row, stack_rows


def make(**kwargs) -> DFlashModule:
    kwargs.setdefault("mask_token_id", MASK_TOKEN)
    kwargs.setdefault("num_draft_layers", 2)
    kwargs.setdefault("block_size", BLOCK)
    kwargs.setdefault("num_anchors", 3)
    return DFlashModule(TINY_TARGETS["qwen3"], **kwargs)


@pytest.mark.parametrize(
    "options",
    [{}, {"sliding_window": 3, "variable_prefix": True, "loss_decay_gamma": None}],
    ids=["plain", "window+variable_prefix"],
)
def test_one_chain_per_anchor_and_a_short_document_counted(options):
    # Packed == padded under these options (loss, gradients, acceptance) is the conformance suite's.
    module = make(**options)
    perturb(module)
    packed_batch, _ = twins(ROWS, width=20)
    anchors = sample_anchors(
        validate_batch(packed_batch), BLOCK, 3, generator=torch.Generator().manual_seed(0)
    )
    prefix = torch.randint(2, BLOCK, anchors.shape, generator=torch.Generator().manual_seed(1))
    extra = {"prefix_lengths": prefix} if options else {}
    with torch.no_grad():
        output = module.compute_loss(packed_batch, anchors=anchors, **extra)
    assert output.correct.shape == (int((anchors >= 0).sum()), BLOCK - 1)
    assert int(output.metrics["short_documents"]) == 1
    assert output.valid.any() and not output.valid.all()  # prompt tokens inside some blocks


@pytest.mark.parametrize("variable_prefix", [False, True])
def test_no_valid_anchor_gives_a_finite_connected_zero_loss(variable_prefix):
    module = make(variable_prefix=variable_prefix)
    batch = with_prompts(
        stack_rows([packed_row(documents([3, 2]), 6), packed_row(documents([3], seed=1), 6)])
    )
    for anchors in (None, torch.empty(2, 0, dtype=torch.long)):
        output = module.compute_loss(batch, anchors=anchors)
        assert output.loss.item() == 0.0 and output.loss.requires_grad
        assert output.correct.shape == (0, BLOCK - 1) and output.valid.shape == (0, BLOCK - 1)
        assert int(output.valid_tokens) == 0 and int(output.metrics["short_documents"]) == 3
        module.zero_grad()
        output.loss.backward()
        assert all(p.grad is not None and not p.grad.any() for p in module.draft.parameters())


def test_block_targets_are_same_position_labels_masked_by_supervision():
    packed = validate_batch(with_prompts(packed_row(documents([6, 7]), 14), prompt=3))
    layout = block_layout(packed, torch.tensor([[0, 2, 6]]), BLOCK)
    ones = torch.ones_like(layout.anchors)
    targets = block_targets(packed, layout, ones)
    ids = packed.input_ids[0]
    assert torch.equal(targets.labels, torch.stack([ids[1:4], ids[3:6], ids[7:10]]))
    expected_valid = [[False, False, True], [True, True, True], [False, False, True]]
    assert targets.valid.tolist() == expected_valid
    # A known prefix of 2 shifts every chain by one slot and cuts it at the block end.
    targets = block_targets(packed, layout, ones * 2)
    assert torch.equal(targets.labels[:, :2], torch.stack([ids[2:4], ids[4:6], ids[8:10]]))
    assert targets.valid[:, 2].logical_not().all()
    assert targets.slots.tolist()[0] == [2, 3, 3]


def decayed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    # The block objectives' weighted mean: one sum over every chain of the micro-batch (NeMo's form).
    nll = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
    return (nll.view_as(labels) * weights).sum() / (weights.sum() + LOSS_EPS)


def test_decayed_cross_entropy_equals_a_naive_weighted_mean():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 3, 11, generator=gen)
    labels = torch.randint(0, 11, (5, 3), generator=gen)
    valid = torch.rand(5, 3, generator=gen) > 0.3
    weights = decay_weights(3, 7.0) * valid
    loss = decayed_cross_entropy(logits, labels, weights)
    numerator = denominator = 0.0
    for m in range(5):
        for j in range(3):
            if valid[m, j]:
                w = torch.exp(torch.tensor(-j / 7.0))
                numerator += w * -torch.log_softmax(logits[m, j], -1)[labels[m, j]]
                denominator += w
    torch.testing.assert_close(loss, numerator / (denominator + 1e-6))
    assert decay_weights(3, None).tolist() == [1.0, 1.0, 1.0]
    assert decay_weights(2, 7.0)[0] == 1.0


def test_loss_decreases_on_a_fixed_batch():
    module = make()
    batch, _ = twins(ROWS, width=20)
    anchors = module.sample_anchors(batch, generator=torch.Generator().manual_seed(0))
    optimizer = torch.optim.Adam(module.draft.parameters(), lr=1e-2)
    losses = []
    for _ in range(25):
        optimizer.zero_grad()
        loss = module.compute_loss(batch, anchors=anchors).loss
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.9 * losses[0]  # a random tiny target: logits start near-uniform (ln 96)


def test_sliding_window_narrows_context_and_a_huge_window_changes_nothing():
    batch, _ = twins(ROWS, width=20)
    anchors = sample_anchors(validate_batch(batch), BLOCK, 3, generator=torch.Generator().manual_seed(2))
    losses = {}
    for window in (None, 1, 64):
        module = make(sliding_window=window)
        perturb(module)
        losses[window] = module.compute_loss(batch, anchors=anchors).loss
    torch.testing.assert_close(losses[64], losses[None])
    assert not torch.allclose(losses[1], losses[None])


def test_flex_block_mask_path_matches_sdpa_on_cpu():
    # Flex has no CPU backward, so the BlockMask path is checked forward-only here (GPU runs it fully).
    batch, _ = twins(ROWS[:2], width=20)
    anchors = sample_anchors(validate_batch(batch), BLOCK, 2, generator=torch.Generator().manual_seed(3))
    outputs = []
    for backend in ("sdpa", "flex"):
        module = make(draft_attn_backend=backend, sliding_window=5)
        perturb(module)
        with torch.no_grad():
            outputs.append(module.compute_loss(batch, anchors=anchors))
    torch.testing.assert_close(outputs[1].loss, outputs[0].loss, rtol=1e-5, atol=1e-6)
    assert torch.equal(outputs[1].correct, outputs[0].correct)


def test_activation_checkpointing_recomputes_draft_layers_without_fsdp_and_changes_nothing():
    batch, _ = twins(ROWS, width=20)
    anchors = sample_anchors(validate_batch(batch), BLOCK, 3, generator=torch.Generator().manual_seed(4))
    results, calls = [], []
    for checkpointing in (False, True):
        module = make(activation_checkpointing=checkpointing)
        perturb(module)
        module.configure_model()  # what every Lightning strategy calls; no device mesh here
        layer, count = module.draft.layers[0], [0]

        def counted(*args, _forward=layer.forward, _count=count, **kwargs):
            _count[0] += 1
            return _forward(*args, **kwargs)

        layer.forward = counted
        results.append(run(module, batch, anchors))
        calls.append(count[0])
    assert_same_results(*results)
    assert calls == [1, 2]  # checkpointed: run again in backward


def test_chunked_logits_equal_one_piece():
    batch, _ = twins(ROWS, width=20)
    anchors = sample_anchors(validate_batch(batch), BLOCK, 3, generator=torch.Generator().manual_seed(4))
    results = []
    for chunk in (None, 2):
        module = make(logits_chunk_blocks=chunk)
        perturb(module)
        results.append(run(module, batch, anchors))
    assert_same_results(*results)


def test_variable_prefix_feeds_the_known_prefix_and_samples_lengths_in_range():
    module = make(variable_prefix=True, block_size=5)
    batch, _ = twins(ROWS, width=20)
    output = module.compute_loss(batch)
    assert torch.isfinite(output.loss) and output.correct.shape[1] == 4
    # Prefix l leaves 4 - l + 1 chain positions: the last position is never valid (l >= 2).
    assert not output.valid[:, -1].any()


def test_rope_inverse_frequencies_stay_fp32_through_dtype_casts():
    module = make()
    reference = module.draft.rotary_emb.inv_freq.clone()
    module.to(torch.bfloat16).to(torch.float16)
    assert module.draft.fc.weight.dtype == torch.float16
    assert module.draft.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(module.draft.rotary_emb.inv_freq, reference)


def test_default_target_layer_spread():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert default_target_layer_ids(8, 1) == [4]
    assert make().target_layer_ids == [1, 5]
    with pytest.raises(ValueError, match="too shallow"):
        default_target_layer_ids(3, 2)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mask_token_id": None}, "mask_token_id is required"),
        ({"mask_token_id": 96}, r"outside the target vocabulary \[0, 96\)"),
        ({"mask_token_id": -1}, "outside the target vocabulary"),
        ({"mask_token_id": 0, "pad_token_id": 0}, "mask_token_id = 0, the tokenizer's pad_token_id"),
        ({"block_size": 1}, "block_size = 1"),
        ({"num_anchors": 0}, "num_anchors = 0"),
        ({"num_draft_layers": 0}, "num_draft_layers = 0"),
        ({"loss_decay_gamma": 0.0}, "loss_decay_gamma"),
        ({"sliding_window": 0}, "sliding_window = 0"),
        ({"prefix_weight_base": 0.0}, "prefix_weight_base"),
        ({"draft_attn_backend": "flash"}, "draft_attn_backend 'flash'"),
        ({"logits_chunk_blocks": 0}, "logits_chunk_blocks = 0"),
        ({"target_layer_ids": [1, 8]}, r"offending: \[8\]"),
        ({"target_layer_ids": []}, "non-empty"),
        ({"target_layer_ids": [5, 1, 3]}, r"\[5, 1, 3\]; it must be strictly increasing \(\[1, 3, 5\]\)"),
        ({"target_layer_ids": [1, 1]}, r"strictly increasing \(\[1\]\)"),
        ({"draft_overrides": {"hidden_size": 64}}, "not overridable"),
        ({"draft_overrides": {"num_key_value_heads": 3}}, "not a multiple"),
    ],
)
def test_construction_guards_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make(**kwargs)


def test_runtime_guards_raise_value_error():
    # Invalid anchors and batches are the conformance suite's; these are the known-prefix guards.
    module = make()
    batch, _ = twins(ROWS, width=20)
    with pytest.raises(ValueError, match="variable_prefix is off"):
        module.compute_loss(
            batch, anchors=torch.tensor([[2], [-1], [-1]]), prefix_lengths=torch.tensor([[2], [2], [2]])
        )
    vp = make(variable_prefix=True)
    with pytest.raises(ValueError, match="shaped like anchors"):
        vp.compute_loss(batch, anchors=torch.tensor([[2], [-1], [-1]]), prefix_lengths=torch.tensor([2]))
    with pytest.raises(ValueError, match=r"outside \[2, 3\]"):
        vp.compute_loss(
            batch, anchors=torch.tensor([[2], [-1], [-1]]), prefix_lengths=torch.tensor([[1], [2], [2]])
        )


def test_export_round_trips_and_has_the_serving_layout(tmp_path):
    module = make(sliding_window=6)
    perturb(module)
    path = module.export(tmp_path / "draft")
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert config["is_causal"] is False and config["block_size"] == BLOCK
    assert config["dflash_config"] == {
        "block_size": BLOCK,
        "mask_token_id": MASK_TOKEN,
        "target_layer_ids": [1, 5],
    }
    assert config["layer_types"] == ["sliding_attention"] * 2 and config["sliding_window"] == 6
    assert config["num_target_layers"] == 8 and config["num_hidden_layers"] == 2
    assert config["hidden_size"] == 32 and config["rope_theta"] == 10000.0
    weights = load_file(str(path / "model.safetensors"))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight"} <= set(
        weights
    )
    assert not any(k.startswith(("model.", "target.", "embed", "lm_head")) or "rotary" in k for k in weights)
    assert weights["fc.weight"].shape == (32, 64)

    draft, _ = load_exported_draft(path)
    for name, value in module.draft.state_dict().items():
        assert torch.equal(draft.state_dict()[name], value), name
    # Reloading it into a module with its loss is the conformance suite's; a mismatched one is refused.
    with pytest.raises(ValueError, match="dflash_config"):
        make(sliding_window=6, block_size=5).load_exported(path)


def test_bf16_export_reloads_with_fp32_rope(tmp_path):
    module = make()
    module.to(torch.bfloat16)
    path = module.export(tmp_path / "bf16")
    draft, config = load_exported_draft(path)
    assert config["torch_dtype"] == "bfloat16" and draft.fc.weight.dtype == torch.bfloat16
    assert draft.rotary_emb.inv_freq.dtype == torch.float32


def test_trains_a_few_steps_in_a_lightning_trainer():
    # Its checkpoint, target-free and exportable through the registry, is the conformance suite's.
    module = make()
    rows = [twins(ROWS, width=20, seed=seed)[0] for seed in range(3)]
    before = {k: v.clone() for k, v in module.draft.state_dict().items()}
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = torch.utils.data.DataLoader(rows, batch_size=None)
    trainer.fit(module, loader)
    assert trainer.global_step == 3
    metrics = trainer.callback_metrics
    assert {"train/loss", "train/accept_len", "train/blocks", "train/acc_pos0"} <= set(metrics)
    assert torch.isfinite(metrics["train/loss"])
    assert any(not torch.equal(before[k], v) for k, v in module.draft.state_dict().items())


def test_the_target_runs_no_layer_after_the_deepest_fused_one():
    # DFlash reads no final state: the layers after its deepest target layer (two of every default spread)
    # would be computed for nothing, in a step and in a capture for it alike.
    module = make(target_layer_ids=[1, 4])
    packed_batch, _ = twins(ROWS, width=20)
    ran, hooks = layers_run(module.target)
    module.compute_loss(packed_batch).loss.backward()
    assert ran == [0, 1, 2, 3, 4]
    ran.clear()
    features = module.features_for(packed_batch)
    assert ran == [0, 1, 2, 3, 4]
    assert "target_last_hidden_state" not in features
    for hook in hooks:
        hook.remove()
