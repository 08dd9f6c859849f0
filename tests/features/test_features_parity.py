"""Training from captured features is the online step: for every draft, one step on a batch that carries
its documents' fp32-captured target features gives the same loss, every gradient, the same chains and
statistics as the step that runs the target, packed and padded; the target's decoder never runs; a
bfloat16 or float8 capture stays within a stated tolerance; and a document's features reach only that
document."""

from __future__ import annotations

import pytest
import torch

from lightning_drafts import DSparkModule
from tests.families.cases import CASES, FAMILIES
from tests.families.family_case import FamilyCase, Tolerance
from tests.families.test_conformance import run
from tests.features.feature_cases import (
    capture,
    corpus,
    first_batch,
    refuse_target_forward,
    without_features,
)
from tests.support.builders import TINY_TARGETS

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:target_layer_ids .* standard SGLang captures"),
]

SHIPPED_DEFAULTS = [
    (CASES[cls], kind)
    for family in FAMILIES[:-1]
    for cls in family.modules
    for kind in CASES[cls].targets[:1]
]
# DSpark reads the final state at every token when it is a feature (its default ids end at L - 1), else
# only before supervised tokens: both stored forms.
DSPARK = CASES[DSparkModule]
SHIPPED = [(case, kind, {}) for case, kind in SHIPPED_DEFAULTS] + [
    (DSPARK, DSPARK.targets[0], {"target_layer_ids": [1, 4]})
]
IDS = [case.name for case, _ in SHIPPED_DEFAULTS] + ["DSparkModule-next_supervised"]
# Measured on these cases: the loss from bfloat16 features within 3e-5 of the online loss (relative),
# from float8 features (a scale per token and layer) within 1.6e-3; the tolerances leave room above both.
BF16 = Tolerance(rtol=1e-3, atol=1e-4)
FLOAT8 = Tolerance(rtol=1e-2, atol=1e-3)


def compare(case: FamilyCase, online, offline, loss: Tolerance | None = None) -> None:
    (a, grads_a), (b, grads_b) = online, offline
    (loss or case.loss).assert_close(b.loss, a.loss, "loss")
    if loss is not None:
        return
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name, grad in grads_a.items():
        case.grads.assert_close(grads_b[name], grad, name)
    assert torch.equal(a.valid, b.valid) and torch.equal(a.correct, b.correct)
    assert a.metrics.keys() == b.metrics.keys()
    for name in a.metrics:
        case.metrics.assert_close(b.metrics[name], a.metrics[name], name)
    for name, (numerator, denominator) in a.sums.items():
        case.metrics.assert_close(b.sums[name][0], numerator, name)
        assert float(b.sums[name][1]) == float(denominator), name


@pytest.mark.parametrize(("case", "kind", "options"), SHIPPED, ids=IDS)
def test_a_step_from_captured_features_equals_the_online_step_packed_and_padded(
    case: FamilyCase, kind, options, tmp_path
):
    module = case.build(TINY_TARGETS[kind], **options)
    docs = corpus()
    store = capture(module, tmp_path / "f32", docs)
    bf16 = capture(module, tmp_path / "bf16", docs, dtype="bfloat16")
    float8 = capture(module, tmp_path / "float8", docs, dtype="float8_e4m3fn")
    for mode in ("microbatch", "padded"):
        batch = first_batch(docs, mode, store)
        online = without_features(batch)
        inputs = case.loss_inputs(module, online, 0)
        expected = run(module, online, inputs)
        assert int(expected[0].valid_tokens) > 0
        guard = refuse_target_forward(module)
        try:
            compare(case, expected, run(module, batch, inputs))
            compare(case, expected, run(module, first_batch(docs, mode, bf16), inputs), loss=BF16)
            compare(case, expected, run(module, first_batch(docs, mode, float8), inputs), loss=FLOAT8)
        finally:
            guard.remove()


@pytest.mark.parametrize(("case", "kind", "options"), SHIPPED, ids=IDS)
def test_changing_one_documents_features_leaves_the_other_documents_unchanged(
    case: FamilyCase, kind, options, tmp_path
):
    module = case.build(TINY_TARGETS[kind], **options)
    docs = corpus()
    batch = first_batch(docs, "microbatch", capture(module, tmp_path, docs))
    # The row holding two or more documents; document `keep` stays supervised, the others are not.
    row = int((batch["seq_lens"] > 0).sum(1).argmax())
    ends = batch["seq_lens"][row].cumsum(0).tolist()
    spans = [slice(begin, end) for begin, end in zip([0, *ends[:-1]], ends, strict=True) if end > begin]
    assert len(spans) >= 2
    keep = max(range(len(spans)), key=lambda i: spans[i].stop - spans[i].start)
    supervised = torch.zeros_like(batch["loss_mask"])
    supervised[row, spans[keep]] = batch["loss_mask"][row, spans[keep]]
    batch = {**batch, "loss_mask": supervised}
    inputs = case.loss_inputs(module, without_features(batch), 0)
    reference, reference_grads = run(module, batch, inputs)
    assert int(reference.valid_tokens) > 0

    def perturbed(span: slice) -> dict:
        changed = dict(batch)
        for key in ("target_hidden_states", "target_last_hidden_state"):
            if key in changed:
                changed[key] = changed[key].clone()
                changed[key][row, span] += 1.0
        return changed

    same = Tolerance(rtol=0.0, atol=1e-5 if kind == "deepseek_v3" else 0.0)
    for other, span in enumerate(spans):
        if other == keep:
            continue
        output, grads = run(module, perturbed(span), inputs)
        same.assert_close(output.loss, reference.loss, f"loss with document {other}'s features changed")
        for name, grad in reference_grads.items():
            same.assert_close(grads[name], grad, name)
    # The check can fail: the document's own features matter.
    assert not torch.allclose(run(module, perturbed(spans[keep]), inputs)[0].loss, reference.loss)


@pytest.mark.parametrize(("case", "kind", "options"), SHIPPED[:-1], ids=IDS[:-1])
def test_a_draft_without_the_targets_decoder_trains_from_features_as_the_full_one_online(
    case: FamilyCase, kind, options, tmp_path
):
    module = case.build(TINY_TARGETS[kind])
    docs = corpus()
    batch = first_batch(docs, "microbatch", capture(module, tmp_path, docs))
    released = case.build(TINY_TARGETS[kind], target_decoder=False)
    assert sum(p.numel() for p in released.target.decoder_layers.parameters()) == 0
    assert all(
        torch.equal(value, released.draft_state_dict()[key])
        for key, value in module.draft_state_dict().items()
    )
    inputs = case.loss_inputs(module, without_features(batch), 0)
    compare(case, run(module, without_features(batch), inputs), run(released, batch, inputs))
    with pytest.raises(
        ValueError, match=r"carries no target features, but the target's decoder was released"
    ):
        released.compute_loss(without_features(batch), **inputs)
