"""EAGLE-3 and MLA-EAGLE-3 equal NeMo Automodel's ``Eagle3TrainerModule`` (the reference implementation, see
``benchmarks/nemo_reference.py``): on the same target, the same draft weights and the same batch, packed and
padded, the loss, every gradient and the acceptance statistics; under each per-step objective NeMo has
(soft cross-entropy, LK ``alpha`` and ``lambda``), with the full and a compressed draft vocabulary."""

from __future__ import annotations

import pytest
import torch

from benchmarks.nemo_reference import eagle3_reference
from lightning_drafts import Eagle3Module, MLAEagle3Module
from lightning_drafts.core.acceptance import prefix_counts
from tests.reference.compare import (
    assert_counts_equal,
    assert_gradients_equal,
    assert_loss_equal,
    batches,
    packed_batch,
    warm_up,
)
from tests.support.builders import TINY_TARGETS

# (module class, target, lk_loss_type, draft_vocab_size)
CASES = {
    "llama-shipped": (Eagle3Module, "shipped:tiny-llama", None, None),
    "qwen3-shipped": (Eagle3Module, "shipped:tiny-qwen3", None, None),
    "llama-random-lk-alpha-compressed-vocab": (Eagle3Module, TINY_TARGETS["llama"], "alpha", 48),
    "llama-random-lk-lambda": (Eagle3Module, TINY_TARGETS["llama"], "lambda", None),
    "mla-shipped": (MLAEagle3Module, "shipped:tiny-deepseek-v3", None, None),
    "mla-random-lk-lambda": (MLAEagle3Module, TINY_TARGETS["deepseek_v3"], "lambda", None),
}


def build(case: str) -> Eagle3Module:
    module_class, target, lk_loss_type, draft_vocab_size = CASES[case]
    torch.manual_seed(0)
    module = module_class(
        target=target, ttt_length=3, lk_loss_type=lk_loss_type, draft_vocab_size=draft_vocab_size
    )
    if draft_vocab_size is not None:
        vocab = module.target.vocab_size
        tokens = torch.cat([b["input_ids"].flatten() for b in batches(vocab).values()])
        # Every batch token first (so most supervised targets are in the draft vocabulary), then ids by index.
        module.build_vocab_mapping(
            torch.bincount(tokens, minlength=vocab) * vocab + torch.arange(vocab).flip(0)
        )
    return module


@pytest.mark.parametrize("case", sorted(CASES))
def test_eagle3_equals_nemo(case):
    module = build(case)
    vocab = module.target.vocab_size
    rows = batches(vocab)
    warm_up(module.draft, lambda: module.compute_loss(rows["packed"]).loss)
    reference = eagle3_reference(module, CASES[case][2])
    for layout, batch in rows.items():
        module.zero_grad()
        reference.draft.zero_grad()
        ours = module.compute_loss(batch)
        ours.loss.backward()
        theirs = reference.step(packed_batch(batch, vocab))
        theirs.loss.backward()
        assert_loss_equal(ours.loss, theirs.loss, f"{layout} loss")
        assert_gradients_equal(module.draft, reference.draft, reference.renames)
        hits, chain_valid = prefix_counts(ours.correct, ours.valid)
        correct, supervised = ours.sums["accuracy"]
        assert_counts_equal(
            {"hits": hits, "chain_valid": chain_valid, "valid_tokens": ours.valid_tokens, "correct": correct},
            {
                "hits": theirs.step_prefix_hits,
                "chain_valid": theirs.step_valid,
                "valid_tokens": theirs.valid_tokens,
                "correct": torch.round(theirs.accuracy * theirs.valid_tokens),
            },
        )
        assert int(supervised) == int(theirs.valid_tokens)
        assert int(hits[0]) > 0, (
            f"{layout}: no chain predicts its first token right; the statistics test nothing"
        )
