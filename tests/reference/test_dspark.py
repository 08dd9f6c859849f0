"""DSpark equals NeMo Automodel's ``DSparkTrainerModule`` (the reference implementation, see
``benchmarks/nemo_reference.py``) with each Markov head (``vanilla``, ``gated``, ``rnn``) and the confidence head
read with or without it: on the same target, the same draft weights, the same batch, packed and padded, and
the same anchors (every valid one, which is what NeMo's draft samples when it may take more than there
are), the loss, its three terms, every gradient and NeMo's diagnostics (``accept_rate@k``, ``tau``, the
confidence calibration sums)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.nemo_reference import dspark_anchors, dspark_reference
from lightning_drafts import DSparkModule
from tests.reference.compare import (
    assert_gradients_equal,
    assert_loss_equal,
    batches,
    packed_batch,
    warm_up,
)
from tests.support.builders import TINY_TARGETS

COMMON = {"block_size": 4, "num_draft_layers": 2, "markov_rank": 16, "draft_attn_backend": "sdpa"}
# (target, options)
CASES = {
    "vanilla-shipped": ("shipped:tiny-qwen3", {"markov_head_type": "vanilla"}),
    "gated-random": (TINY_TARGETS["qwen3"], {"markov_head_type": "gated"}),
    "rnn-random-no-decay": (TINY_TARGETS["qwen3"], {"markov_head_type": "rnn", "loss_decay_gamma": None}),
    "gated-random-confidence-alone": (
        TINY_TARGETS["qwen3"],
        {"markov_head_type": "gated", "confidence_head_with_markov": False, "target_layer_ids": [1, 4]},
    ),
}


def assert_sums_close(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    """Float sums of per-slot probabilities: equal within fp32 round-off."""
    ours, theirs = torch.as_tensor(ours).double().flatten(), torch.as_tensor(theirs).double().flatten()
    assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-5), (
        f"{what}: ours {ours.tolist()}, NeMo's {theirs.tolist()}"
    )


@pytest.mark.parametrize("case", sorted(CASES))
def test_dspark_equals_nemo(case):
    target, options = CASES[case]
    module = DSparkModule(target=target, mask_token_id=5, num_anchors=8, **COMMON, **options)
    vocab = module.target.vocab_size
    rows = batches(vocab)
    anchors = {layout: dspark_anchors(packed_batch(batch, vocab)) for layout, batch in rows.items()}
    warm_up(
        module.draft, lambda: sum(module.compute_loss(b, anchors[layout]).loss for layout, b in rows.items())
    )
    for layout, batch in rows.items():
        reference = dspark_reference(module, batch["input_ids"].shape[1])
        module.zero_grad()
        reference.draft.zero_grad()
        ours = module.compute_loss(batch, anchors[layout])
        ours.loss.backward()
        theirs = reference.step(packed_batch(batch, vocab))
        theirs.loss.backward()
        assert_loss_equal(ours.loss, theirs.loss, f"{layout} loss")
        for term, nemo_term in (
            ("ce_loss", "ce_loss"),
            ("tv_loss", "l1_loss"),
            ("confidence_loss", "confidence_loss"),
        ):
            assert_loss_equal(ours.metrics[term], getattr(theirs, nemo_term), f"{layout} {term}")
        assert_gradients_equal(module.draft, reference.draft, reference.renames)
        sums = ours.sums
        per_slot = [sums[f"accept_rate_k{k}"] for k in range(module.block_size)]
        assert_sums_close(
            torch.stack([n for n, _ in per_slot]), theirs.accept_rate_per_pos_num, "accept_rate@k"
        )
        assert [int(d) for _, d in per_slot] == theirs.accept_rate_per_pos_den.long().tolist()
        assert_sums_close(sums["tau"][0], theirs.tau_num, "tau")
        assert int(sums["tau"][1]) == int(theirs.tau_den) > 0
        for name in ("confidence_abs_error", "confidence_bias", "confidence_cumprod_bias"):
            assert_sums_close(sums[name][0], getattr(theirs, f"{name}_num"), name)
            assert_sums_close(sums[name][1], theirs.confidence_diag_den, f"{name} weights")
