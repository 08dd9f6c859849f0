"""DFlash and DFlash2 equal NeMo Automodel's ``DFlashTrainerModule`` / ``DFlash2TrainerModule`` (the
reference implementation, see ``benchmarks/nemo_reference.py``): on the same target, the same draft weights, the
same batch, packed and padded, and the same explicit anchors, the loss, every gradient and the block
statistics; under each objective NeMo has (``dflash`` with and without the depth decay, ``variable_prefix``
with the same prefix lengths, DFlash2's selector term).

DFlash's ``correct`` / ``valid`` chains feed the project's ``accept_len`` (tau_sim: a chain stops at its
first unsupervised position); NeMo's block figure skips such holes and is the project's
``accept_len_skip_holes``, which is what is compared (docs/concepts/dflash.md#block-acceptance)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.nemo_reference import dflash_reference
from lightning_drafts import DFlash2Module, DFlashModule
from lightning_drafts.blockdraft.objective import sample_prefix_lengths
from tests.reference.compare import (
    assert_counts_equal,
    assert_gradients_equal,
    assert_loss_equal,
    batches,
    packed_batch,
    warm_up,
)
from tests.support.builders import TINY_TARGETS

BLOCK = 4
COMMON = {"block_size": BLOCK, "num_draft_layers": 2, "num_anchors": 3, "draft_attn_backend": "sdpa"}
DFLASH2 = {"selector_top_k": 4, "selector_rank": 16}
# (module class, target, options)
CASES = {
    "dflash-shipped": (DFlashModule, "shipped:tiny-qwen3", {}),
    "dflash-random-no-decay": (DFlashModule, TINY_TARGETS["qwen3"], {"loss_decay_gamma": None}),
    "dflash-random-variable-prefix": (DFlashModule, TINY_TARGETS["qwen3"], {"variable_prefix": True}),
    "dflash2-shipped": (DFlash2Module, "shipped:tiny-qwen3", DFLASH2),
    "dflash2-random": (DFlash2Module, TINY_TARGETS["qwen3"], {**DFLASH2, "selector_loss_weight": 0.5}),
}


def anchors_for(module: DFlashModule, batch: dict, seed: int) -> torch.Tensor:
    return module.sample_anchors(batch, torch.Generator().manual_seed(seed))


def prefixes_for(module: DFlashModule, anchors: torch.Tensor, seed: int) -> torch.Tensor | None:
    if not module.variable_prefix:
        return None
    draws = sample_prefix_lengths(
        anchors.numel(), BLOCK, module.prefix_weight_base, torch.Generator().manual_seed(seed)
    )
    return draws.view(anchors.shape)


@pytest.mark.parametrize("case", sorted(CASES))
def test_dflash_equals_nemo(case):
    module_class, target, options = CASES[case]
    module = module_class(target=target, mask_token_id=5, **COMMON, **options)
    vocab = module.target.vocab_size
    rows = batches(vocab)
    anchors = {layout: anchors_for(module, batch, 1) for layout, batch in rows.items()}
    prefixes = {layout: prefixes_for(module, anchors[layout], 1) for layout in rows}

    def both_losses() -> torch.Tensor:
        return sum(
            module.compute_loss(b, anchors[layout], prefixes[layout]).loss for layout, b in rows.items()
        )

    warm_up(module.draft, both_losses, steps=12, lr=5e-2)
    reference = dflash_reference(module)
    for layout, batch in rows.items():
        module.zero_grad()
        reference.draft.zero_grad()
        ours = module.compute_loss(batch, anchors[layout], prefixes[layout])
        ours.loss.backward()
        theirs = reference.step(packed_batch(batch, vocab), anchors[layout], prefixes[layout])
        theirs.loss.backward()
        assert_loss_equal(ours.loss, theirs.loss, f"{layout} loss")
        assert_gradients_equal(module.draft, reference.draft, reference.renames)
        accepted, blocks = ours.sums["accept_len_skip_holes"]
        counts = {
            "valid_tokens": ours.valid.sum(),
            "correct_tokens": (ours.correct & ours.valid).sum(),
            "accept_len_sum": accepted,
            "valid_blocks": blocks,
        }
        expected = {name: getattr(theirs, name) for name in counts}
        if module_class is DFlash2Module:
            assert_loss_equal(ours.metrics["base_loss"], theirs.base_loss, f"{layout} base loss")
            assert_loss_equal(ours.metrics["selector_loss"], theirs.selector_loss, f"{layout} selector loss")
            recalled, supervised = ours.sums["candidate_recall"]
            counts["recalled"] = recalled
            expected["recalled"] = torch.round(theirs.candidate_recall * theirs.valid_tokens)
            assert int(supervised) == int(theirs.valid_tokens)
        assert_counts_equal(counts, expected)
        assert int(counts["correct_tokens"]) > 0, (
            f"{layout}: no prediction is right; the statistics test nothing"
        )
