"""Validating before training on the same Trainer: the metric states a validation (inference mode) resets
must still take a later fit's in-place updates."""

from __future__ import annotations

import lightning as L
import torch

from lightning_drafts import DFlashModule
from tests.block_draft_cases import BLOCK, MASK_TOKEN, ROWS, twins
from tests.builders import TINY_TARGETS


def test_validate_then_fit_on_one_trainer():
    module = DFlashModule(
        TINY_TARGETS["qwen3"], mask_token_id=MASK_TOKEN, num_draft_layers=2, block_size=BLOCK, num_anchors=3
    )
    loader = torch.utils.data.DataLoader(
        [twins(ROWS, width=20, seed=s)[0] for s in range(2)], batch_size=None
    )
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=2,
        val_check_interval=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    (before,) = trainer.validate(module, loader, verbose=False)
    trainer.fit(module, loader, loader)
    assert trainer.global_step == 2
    after = trainer.callback_metrics
    for name in ("val/accept_len", "val/accept_len_skip_holes"):
        assert name in before and name in after
