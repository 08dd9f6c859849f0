"""Validating before training on the same Trainer: the metric states a validation (inference mode) resets
must still take a later fit's in-place updates: the logged acceptance lengths before and after fit are those
of the weights of that moment, by their definitions written out."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from lightning_drafts import DFlashModule
from tests.families.dflash.cases import perfect_module
from tests.support.acceptance_reference import accept_len_by_definition
from tests.support.builders import packed_row


def skip_holes_by_definition(outputs) -> float:
    """NeMo's block acceptance (docs/concepts/dflash.md#block-acceptance): per chain with a valid slot, 1 +
    the valid slots reached with every valid slot before them correct (unsupervised slots skipped), averaged
    over such chains."""
    lengths = []
    for output in outputs:
        for correct, valid in zip(output.correct.tolist(), output.valid.tolist(), strict=True):
            if not any(valid):
                continue
            accepted, alive = 0, True
            for c, v in zip(correct, valid, strict=True):
                if v:
                    alive = alive and c
                    accepted += alive
            lengths.append(1 + accepted)
    return sum(lengths) / len(lengths)


def expected_metrics(module: DFlashModule, loader) -> dict[str, float]:
    was_training = module.training
    module.eval()
    with torch.no_grad():
        outputs = [module.compute_loss(batch) for batch in loader]
    module.train(was_training)
    return {
        "val/accept_len": accept_len_by_definition(outputs),
        "val/accept_len_skip_holes": skip_holes_by_definition(outputs),
    }


def test_validate_then_fit_on_one_trainer():
    # A draft that predicts every block slot right on one-token documents (tests.families.dflash.cases), so
    # the statistics are far from those of empty (reset) states; every block it samples is all correct.
    module = perfect_module(DFlashModule)
    loader = torch.utils.data.DataLoader(
        [
            packed_row([torch.full((n,), t) for n, t in docs], 20)
            for docs in (((9, 3), (11, 40)), ((10, 11), (10, 21)))
        ],
        batch_size=None,
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
    initial = expected_metrics(module, loader)
    (before,) = trainer.validate(module, loader, verbose=False)
    trainer.fit(module, loader, loader)
    assert trainer.global_step == 2
    # The last validation ran after the last step: the final weights' statistics.
    final = expected_metrics(module, loader)
    after = trainer.callback_metrics
    assert initial["val/accept_len"] > 2 and final["val/accept_len"] > 2
    for name in ("val/accept_len", "val/accept_len_skip_holes"):
        assert float(before[name]) == pytest.approx(initial[name], rel=1e-6), name
        assert float(after[name]) == pytest.approx(final[name], rel=1e-6), name
