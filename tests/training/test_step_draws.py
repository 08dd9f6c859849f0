"""The per-micro-batch random draws (block-draft anchors, variable prefixes): each input of the generator's
key (the run's seed, the stage, the global step, the rank, the micro-batch) changes the draws, and equal
inputs give equal draws. A resumed run equal to an uninterrupted one cannot show this: a generator blind to
the rank draws the same anchors on every rank of both runs alike."""

from __future__ import annotations

import pytest
import torch

from lightning_drafts.training.step_draws import GLOBAL_SEED_ENV, micro_batch_generator, step_generator

KEY = {"seed": 3, "stage": "train", "step": 5, "rank": 1, "micro_batch": 2}
# Another value of each input, one at a time.
OTHER = {"seed": 4, "stage": "val", "step": 6, "rank": 0, "micro_batch": 3}


def draws(generator: torch.Generator) -> torch.Tensor:
    # Enough draws that two independent generators agreeing on all of them by chance is out of the question.
    return torch.randint(0, 2**31 - 1, (16,), generator=generator)


def test_equal_inputs_draw_equal_numbers():
    assert torch.equal(draws(step_generator(**KEY)), draws(step_generator(**KEY)))


@pytest.mark.parametrize("field", sorted(KEY))
def test_each_input_of_the_key_changes_the_draws(field):
    changed = {**KEY, field: OTHER[field]}
    assert not torch.equal(draws(step_generator(**KEY)), draws(step_generator(**changed))), field


def test_a_fits_micro_batches_are_keyed_by_their_place_in_the_step(monkeypatch):
    monkeypatch.setenv(GLOBAL_SEED_ENV, "11")
    # Training, 3 micro-batches a step: batch 7 is the second micro-batch (7 mod 3) of its step.
    trained = micro_batch_generator("train", 7, step=2, rank=1, accumulate=3)
    assert torch.equal(draws(trained), draws(step_generator(11, "train", 2, 1, 1)))
    # Validation keeps the global step while its batches run: each batch is its own micro-batch.
    first, second = (micro_batch_generator("val", i, step=2, rank=1, accumulate=3) for i in (0, 3))
    assert torch.equal(draws(second), draws(step_generator(11, "val", 2, 1, 3)))
    assert not torch.equal(draws(first), draws(micro_batch_generator("val", 3, step=2, rank=1, accumulate=3)))
    # Another rank, the same batch: other draws.
    other_rank = micro_batch_generator("train", 7, step=2, rank=0, accumulate=3)
    assert not torch.equal(draws(other_rank), draws(micro_batch_generator("train", 7, 2, 1, 3)))
