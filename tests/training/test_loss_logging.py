"""What `val/loss` means: the mean over the supervised predictions of the epoch, not over micro-batches
(a micro-batch with nothing supervised weighs nothing)."""

from __future__ import annotations

import lightning as L
import torch

from lightning_drafts import Eagle3Module
from tests.support.builders import TINY_TARGETS, packed_row, random_docs, stack_rows


def batch(lengths: list[int], seed: int, supervised: bool = True) -> dict[str, torch.Tensor]:
    row = stack_rows([packed_row(random_docs(lengths, seed=seed), 24)])
    if not supervised:
        row["loss_mask"] = torch.zeros_like(row["loss_mask"])
    return row


def module() -> Eagle3Module:
    torch.manual_seed(0)
    return Eagle3Module(TINY_TARGETS["llama"], ttt_length=2)


def test_the_validation_loss_is_weighted_by_supervised_predictions():
    draft = module()
    rows = [batch([20], 3), batch([5], 4), batch([9, 8], 5, supervised=False)]
    with torch.no_grad():
        outputs = [draft.compute_loss(row) for row in rows]
    tokens = torch.tensor([float(o.valid_tokens) for o in outputs])
    losses = torch.stack([o.loss for o in outputs])
    assert tokens[0] > 2 * tokens[1] > 0 and tokens[2] == 0
    trainer = L.Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False
    )
    (metrics,) = trainer.validate(draft, torch.utils.data.DataLoader(rows, batch_size=None), verbose=False)
    expected = float((losses * tokens).sum() / tokens.sum())
    assert abs(metrics["val/loss"] - expected) < 1e-6
    assert abs(metrics["val/loss"] - float(losses[:2].mean())) > 1e-4  # the per-batch mean differs
