"""Checks shared by the dense and MLA EAGLE-3 tests (tests/families/eagle3/test_eagle3.py, test_mla_eagle3.py).

Packed == padded, document isolation, bad batches and the export round trip are the conformance suite's
(tests/families/test_conformance.py); these are EAGLE-3's own.
"""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from lightning_drafts.core.acceptance import prefix_counts
from lightning_drafts.eagle3 import Eagle3Base
from lightning_drafts.eagle3.ttt import shift_left, step_masks
from tests.support.acceptance_reference import accept_len_by_definition
from tests.support.builders import VOCAB, packed_row, random_docs, stack_rows

GRAD_TOLERANCE = {"rtol": 1e-4, "atol": 1e-6}


def frequencies(seed: int = 0) -> torch.Tensor:
    """Distinct, skewed counts so the draft vocabulary is an unsorted subset of the target's."""
    return torch.randperm(VOCAB, generator=torch.Generator().manual_seed(seed)) * 3 + 1


def build(module_class: type[Eagle3Base], target: dict, **kwargs) -> Eagle3Base:
    torch.manual_seed(0)
    defaults = {"ttt_length": 3, "draft_vocab_size": 48, "token_frequencies": frequencies()}
    return module_class(target, **{**defaults, **kwargs})


def run(module: Eagle3Base, batch: dict) -> tuple[object, dict[str, torch.Tensor]]:
    module.zero_grad(set_to_none=True)
    output = module.compute_loss(batch)
    output.loss.backward()
    grads = {name: p.grad.clone() for name, p in module.draft.named_parameters() if p.requires_grad}
    return output, grads


def assert_same_objective(module: Eagle3Base, first: dict, second: dict) -> None:
    """Same loss, every draft gradient, the same chains and the same acceptance counts."""
    a, grads_a = run(module, first)
    b, grads_b = run(module, second)
    assert int(a.valid_tokens) == int(b.valid_tokens) > 0
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-5, atol=1e-6)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 5
    for name in grads_a:
        assert grads_a[name] is not None and grads_a[name].abs().sum() > 0, f"{name} got no gradient"
        torch.testing.assert_close(
            grads_a[name], grads_b[name], **GRAD_TOLERANCE, msg=lambda m, n=name: f"{n}: {m}"
        )
    assert torch.equal(a.valid, b.valid)
    assert torch.equal(a.correct, b.correct)
    for count_a, count_b in zip(
        prefix_counts(a.correct, a.valid), prefix_counts(b.correct, b.valid), strict=True
    ):
        assert torch.equal(count_a, count_b)


def check_gate_worked_example(module_class: type[Eagle3Base], target: dict) -> None:
    """docs/concepts/eagle3.md#packing: two documents of 4 in T = 8, all-ones mask, K = 4: 26 ungated vs 12
    gated."""
    trainer_mask = torch.ones(2, 8, dtype=torch.bool)
    doc_remaining = torch.tensor([[3, 2, 1, 0, 3, 2, 1, 0]] * 2)
    ungated = sum(int(step_masks(trainer_mask, trainer_mask, None, k)[1].sum()) for k in range(4))
    gated = sum(int(step_masks(trainer_mask, trainer_mask, doc_remaining, k)[1].sum()) for k in range(4))
    assert (ungated, gated) == (2 * 26, 2 * 12)
    # The same count through the module: dataset-frame all-ones mask, full vocabulary, K = 4.
    module = build(module_class, target, ttt_length=4, draft_vocab_size=None, token_frequencies=None)
    batch = packed_row(random_docs([4, 4], seed=5), 8)
    with torch.no_grad():
        output = module.compute_loss(batch)
    assert int(output.valid_tokens) == 12
    assert output.valid.sum(0).tolist() == [6, 4, 2, 0]
    # A 2-token prompt per document: step k of slot o (offset in its document of 4) is supervised iff its
    # target o + 1 + k is an answer offset (2 or 3): per document [2, 2, 1, 0] over the four steps.
    prompted = dict(batch, loss_mask=batch["loss_mask"] * (batch["position_ids"] >= 2).long())
    with torch.no_grad():
        output = module.compute_loss(prompted)
    assert output.valid.sum(0).tolist() == [4, 4, 2, 0] and int(output.valid_tokens) == 10
    assert torch.equal(shift_left(torch.arange(5)[None], 2), torch.tensor([[2, 3, 4, 0, 0]]))


def check_guards(module_class: type[Eagle3Base], target: dict) -> None:
    for bad in (0, -1, 1.0, True):
        with pytest.raises(ValueError, match="ttt_length"):
            module_class(target, ttt_length=bad)
    for bad in ([1, 1, 3], [1, 3], [1, 3, 8], [-1, 2, 3], [5, 3, 1], (1, 2, 3.0)):
        with pytest.raises(ValueError, match="target_layer_ids"):
            module_class(target, target_layer_ids=bad)
    for bad in (0, -4, 2.5):
        with pytest.raises(ValueError, match="draft_vocab_size"):
            module_class(target, draft_vocab_size=bad)
    with pytest.raises(ValueError, match=rf"draft_vocab_size = {VOCAB + 1} is larger .* of {VOCAB} ids"):
        module_class(target, draft_vocab_size=VOCAB + 1)
    with pytest.raises(ValueError, match="loss_decay_gamma"):
        module_class(target, loss_decay_gamma=0.0)
    with pytest.raises(ValueError, match="draft_attn_backend"):
        module_class(target, draft_attn_backend="flash")
    with pytest.raises(ValueError, match="activation_checkpointing=True .* TTT cache"):
        module_class(target, activation_checkpointing=True)
    with pytest.raises(ValueError, match="token_frequencies"):
        module_class(target, draft_vocab_size=16, token_frequencies=torch.ones(VOCAB - 1, dtype=torch.long))

    # Bad batches and anchors are the conformance suite's (tests/families/test_conformance.py).
    good = packed_row(random_docs([5, 6], seed=6), 12)
    unmapped = build(module_class, target, token_frequencies=None)
    with pytest.raises(ValueError, match="not built"):
        unmapped.compute_loss(good)
    with pytest.raises(ValueError, match="not built"):
        unmapped.export("unused")


def check_loss_decreases(module_class: type[Eagle3Base], target: dict) -> None:
    module = build(module_class, target)
    with torch.no_grad():
        # A random tiny target is nearly uniform; a sharper teacher leaves the draft something to learn.
        module.target.lm_head.weight.mul_(10)
    batch = stack_rows(
        [packed_row(random_docs([8, 7], seed=7), 16), packed_row(random_docs([12], seed=8), 16)]
    )
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(8):
        optimizer.zero_grad()
        loss = module.compute_loss(batch).loss
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert all(later < earlier for earlier, later in zip(losses, losses[1:], strict=False)), losses
    assert losses[-1] < losses[0] - 0.2, losses
    assert not module.draft.embed_tokens.weight.requires_grad
    assert all(not p.requires_grad for p in module.target.parameters())


def check_export_round_trip(module_class: type[Eagle3Base], target: dict, tmp_path) -> dict:
    module = build(module_class, target, target_layer_ids=[2, 3, 5])
    with torch.no_grad():
        module.draft.norm.weight.mul_(1.5)  # weights that differ from a fresh init
        module.draft.lm_head.weight.mul_(1.5)  # the export validator refuses an LM head still at its init
    out = module.export(tmp_path / "draft")
    config = json.loads((out / "config.json").read_text())
    weights = load_file(str(out / "model.safetensors"))
    assert (
        config["num_hidden_layers"] == 1
        and config["draft_vocab_size"] == 48
        and config["vocab_size"] == VOCAB
    )
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 3, 5]
    assert config["eagle_aux_hidden_state_layer_ids"] == [3, 4, 6]
    assert weights["d2t"].dtype == torch.int64 and weights["t2d"].dtype == torch.bool
    selected = weights["d2t"] + torch.arange(48)
    assert torch.equal(selected, module.vocab_mapping.selected_token_ids)
    assert not torch.equal(selected, selected.sort().values), "the mapping should be unsorted in this test"
    assert not any(name.startswith(("model.", "target.")) for name in weights)
    # Reloading it into the same draft (weights, loss, captured layers) is the conformance suite's.
    return {"config": config, "weights": weights}


class ContractRows(torch.utils.data.Dataset):
    """Packed contract rows (two documents each) for a plain DataLoader."""

    def __init__(self, rows: int = 6, width: int = 16) -> None:
        self.rows = [packed_row(random_docs([7, 6], seed=100 + i), width) for i in range(rows)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {key: value[0] for key, value in self.rows[index].items()}


class RowsDataModule(L.LightningDataModule):
    def train_dataloader(self) -> DataLoader:
        return DataLoader(ContractRows(), batch_size=2)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(ContractRows(rows=2), batch_size=2)


def check_trains_in_lightning_trainer(module_class: type[Eagle3Base], target: dict, tmp_path) -> None:
    # Through a datamodule: setup() scans its train loader for the vocabulary mapping.
    module = build(module_class, target, token_frequencies=None)
    assert not bool(module.vocab_mapping_built)
    trainer = lightning_trainer(tmp_path)
    trainer.fit(module, datamodule=RowsDataModule())
    assert bool(module.vocab_mapping_built) and 0 < module.vocab_mapping.coverage < 1
    metrics = trainer.callback_metrics
    for name in (
        "train/loss",
        "train/accept_len",
        "train/acc_pos0",
        "train/acc_pos2",
        "train/valid_tokens",
        "val/loss",
    ):
        assert name in metrics and torch.isfinite(metrics[name]), name
    # The one validation run followed the last step: its logged loss and acceptance length are those of the
    # final weights on the validation batch, the length by its definition written out.
    module.eval()
    with torch.no_grad():
        output = module.compute_loss(next(iter(RowsDataModule().val_dataloader())))
    assert float(metrics["val/loss"]) == pytest.approx(float(output.loss), rel=1e-5)
    assert float(metrics["val/accept_len"]) == pytest.approx(accept_len_by_definition([output]), rel=1e-6)
    module.train()

    trainer.save_checkpoint(tmp_path / "draft.ckpt")
    checkpoint = torch.load(tmp_path / "draft.ckpt", weights_only=False)
    assert not any(key.startswith("target.") for key in checkpoint["state_dict"])
    assert "token_frequencies" not in checkpoint["hyper_parameters"]
    restored = module_class.load_from_checkpoint(tmp_path / "draft.ckpt")
    assert bool(restored.vocab_mapping_built)
    assert torch.equal(restored.draft.d2t, module.draft.d2t)
    # A checkpoint with activation_checkpointing / shard_target on still exports: the conformance suite's.

    # Through a plain DataLoader of contract dicts, with the frequencies given up front.
    module = build(module_class, target)
    lightning_trainer(tmp_path).fit(module, train_dataloaders=DataLoader(ContractRows(), batch_size=2))
    # Without frequencies or a datamodule there is nothing to build the mapping from.
    with pytest.raises(ValueError, match="token frequencies"):
        lightning_trainer(tmp_path).fit(
            build(module_class, target, token_frequencies=None), train_dataloaders=DataLoader(ContractRows())
        )


def lightning_trainer(tmp_path) -> L.Trainer:
    return L.Trainer(
        max_steps=3,
        limit_val_batches=1,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
