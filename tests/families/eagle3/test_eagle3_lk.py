"""EAGLE-3 / MLA-EAGLE-3 ``lk_loss_type`` (docs/concepts/eagle3.md#loss): each objective against a reference
written from the spec's formulas, packed == padded, the unit of lambda's mean acceptance, and the guards."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_drafts import Eagle3Module, MLAEagle3Module
from tests.support.builders import TINY_TARGETS, packed_row, padded_rows, random_docs, stack_rows
from tests.support.eagle3_checks import GRAD_TOLERANCE, assert_same_objective, build, run

FAMILIES = [(Eagle3Module, "llama"), (MLAEagle3Module, "deepseek_v3")]
IDS = ["eagle3", "mla_eagle3"]
LK = [None, "alpha", "lambda"]


def twins() -> tuple[dict, dict]:
    """Packed rows with trailing padding and their padded twin; each document's first token and its
    fifth (a hole) unsupervised; two documents shorter than the TTT unroll."""
    lengths = [6, 9, 3, 7, 2, 8]
    docs = random_docs(lengths, seed=7)
    packed = stack_rows([packed_row(docs[:2], 16), packed_row(docs[2:4], 16), packed_row(docs[4:], 16)])
    padded = padded_rows(docs, 9)
    packed_starts = [(0, 0), (0, 6), (1, 0), (1, 3), (2, 0), (2, 2)]
    for doc, length in enumerate(lengths):
        for offset in (0, 4):
            if offset < length:
                row, start = packed_starts[doc]
                packed["loss_mask"][row, start + offset] = 0
                padded["loss_mask"][doc, offset] = 0
    return packed, padded


def reference_loss(
    module, batch: dict, lk_loss_type: str | None, scale: float, decay: float, by_row: bool = False
) -> torch.Tensor:
    """``sum_k 0.8^k L_k / sum_k 0.8^k`` from the draft's logits and the teacher, written out.

    Slot i at step k is taught the teacher's distribution at i + 1 + k when that token is supervised,
    still in slot i's document and its greedy target token is in the draft vocabulary. ``by_row`` takes
    lambda's mean acceptance per row instead of over the micro-batch (what packing must not depend on).
    """
    packed = module.prepare_batch(batch)
    with torch.no_grad():
        teacher = module.teacher_signal(packed)
    logits = module.draft_logits(packed)
    steps, (rows_count, width) = logits.shape[0], packed.shape
    total = 0.0
    for k in range(steps):
        slots = [
            (b, i)
            for b in range(rows_count)
            for i in range(width - 1 - k)
            if packed.loss_mask[b, i + 1 + k]
            and k < packed.doc_remaining[b, i]
            and teacher.in_draft_vocab[b, i + 1 + k]
        ]
        if not slots:
            continue
        rows = torch.tensor([b for b, _ in slots])
        positions = torch.tensor([i for _, i in slots])
        student = logits[k, rows, positions].double()
        target = torch.softmax(teacher.logits[teacher.row[rows, positions + 1 + k]].double(), dim=-1)
        log_draft = torch.log_softmax(student, dim=-1)
        soft_ce = -(target * log_draft).sum(-1)
        alpha = torch.minimum(target, log_draft.exp()).sum(-1)
        if lk_loss_type is None:
            step = soft_ce.mean()
        elif lk_loss_type == "alpha":
            step = -torch.where(alpha > 0, torch.log(alpha), torch.zeros_like(alpha)).mean()
        else:
            groups = (
                [rows == b for b in rows.unique()] if by_row else [torch.ones_like(rows, dtype=torch.bool)]
            )
            step = 0.0
            for group in groups:
                kappa = scale * math.exp(-decay * float(alpha[group].detach().mean()))
                step = step + (kappa * soft_ce[group].sum() + (1 - kappa) * (1 - alpha[group]).sum()) / len(
                    slots
                )
        total = total + 0.8**k * step
    return total / sum(0.8**k for k in range(steps))


def draft_grads(module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    module.zero_grad(set_to_none=True)
    loss.backward()
    return {name: p.grad.clone() for name, p in module.draft.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("lk_loss_type", LK)
@pytest.mark.parametrize("module_class, family", FAMILIES, ids=IDS)
def test_every_lk_objective_equals_the_reference(module_class, family, lk_loss_type):
    options = {"lk_loss_type": lk_loss_type, "lk_kl_scale": 0.7, "lk_kl_decay": 2.0}
    module = build(module_class, TINY_TARGETS[family], ttt_length=4, **options)
    packed, _ = twins()
    output, grads = run(module, packed)
    assert not output.valid[:, -1].all() and output.valid[:, 0].any()  # chains cut by holes and document ends
    expected = reference_loss(module, packed, lk_loss_type, 0.7, 2.0)
    expected_grads = draft_grads(module, expected)
    torch.testing.assert_close(output.loss.double(), expected.detach(), rtol=1e-5, atol=1e-7)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name].float(), **GRAD_TOLERANCE, msg=name)


@pytest.mark.parametrize("lk_loss_type", ["alpha", "lambda"])
@pytest.mark.parametrize("module_class, family", FAMILIES, ids=IDS)
def test_packed_rows_equal_padded_rows(module_class, family, lk_loss_type):
    module = build(module_class, TINY_TARGETS[family], ttt_length=4, lk_loss_type=lk_loss_type)
    assert_same_objective(module, *twins())


def test_lambda_mean_acceptance_is_taken_over_the_micro_batch_not_per_row():
    module = build(Eagle3Module, TINY_TARGETS["llama"], ttt_length=4, lk_loss_type="lambda", lk_kl_decay=1.0)
    packed, padded = twins()
    with torch.no_grad():  # a peaked draft, so the acceptance differs from row to row
        head = module.draft.lm_head.weight
        head.add_(torch.randn(head.shape, generator=torch.Generator().manual_seed(9)))
        per_row = {
            name: float(reference_loss(module, batch, "lambda", 1.0, 1.0, by_row=True))
            for name, batch in (("packed", packed), ("padded", padded))
        }
        losses = {
            name: float(module.compute_loss(batch).loss)
            for name, batch in (("packed", packed), ("padded", padded))
        }
    assert losses["packed"] == pytest.approx(losses["padded"], rel=1e-6)
    # A per-row mean would make the loss depend on which documents share a row.
    assert abs(per_row["packed"] - per_row["padded"]) > 1e-3


@pytest.mark.parametrize("lk_loss_type", LK)
def test_a_step_without_supervised_slots_adds_nothing(lk_loss_type):
    module = build(Eagle3Module, TINY_TARGETS["llama"], ttt_length=4, lk_loss_type=lk_loss_type)
    batch = packed_row(random_docs([4, 3, 4], seed=8), 11)  # no document reaches step 3
    with torch.no_grad():
        output = module.compute_loss(batch)
        expected = reference_loss(module, batch, lk_loss_type, 1.0, 3.0)
    assert not output.valid[:, 3].any() and output.valid[:, 2].any()
    torch.testing.assert_close(output.loss.double(), expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"lk_loss_type": "tv"}, r"lk_loss_type 'tv' is unknown; choose one of \(None, 'alpha', 'lambda'\)"),
        ({"lk_loss_type": "lk-alpha"}, "lk_loss_type 'lk-alpha' is unknown"),
        ({"lk_kl_scale": 1.5}, r"lk_kl_scale = 1.5 must be a number in \[0, 1\]"),
        ({"lk_kl_scale": -0.1}, r"lk_kl_scale = -0.1 must be a number in \[0, 1\]"),
        ({"lk_kl_decay": -1.0}, "lk_kl_decay = -1.0 must be a finite number >= 0"),
        ({"lk_kl_decay": float("nan")}, "lk_kl_decay = nan"),
    ],
)
@pytest.mark.parametrize("module_class, family", FAMILIES, ids=IDS)
def test_lk_options_are_checked_at_construction(module_class, family, kwargs, match):
    with pytest.raises(ValueError, match=match):
        module_class(TINY_TARGETS[family], **kwargs)
