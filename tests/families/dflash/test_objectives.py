"""DFlash / DFlash2 ``loss_type`` objectives (docs/concepts/dflash.md#objective) and NeMo's block acceptance.

Every objective is checked against a reference written here from the spec's formulas (float64, loops,
unchunked) on random logits over a batch with loss-mask holes, a document shorter than a block, blocks
that end at their document's end, a block with no supervised label and documents that share a row with
different numbers of blocks; then packed == padded (loss, every gradient, statistics, ratio sums) and
chunked == one piece through the modules.
"""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch

from lightning_drafts import DFlash2Module, DFlashModule
from lightning_drafts.attention.block_masks import block_layout
from lightning_drafts.blockdraft.objective import block_targets, chain_hidden, decay_weights
from lightning_drafts.core.acceptance import acceptance_length, prefix_counts, skip_holes_accept_sums
from lightning_drafts.core.batch import validate_batch
from lightning_drafts.core.chunked_terms import over_chunks
from lightning_drafts.core.draft_output import DraftOutput
from lightning_drafts.core.gold_nll import nll_and_argmax
from lightning_drafts.dflash.objectives import LOSS_TYPES, BlockObjective, dpace_weights
from tests.support.block_draft_cases import (
    BLOCK,
    MASK_TOKEN,
    documents,
    holed_case,
    perturb,
    run,
    supervise_holes,
    to_padded,
)
from tests.support.builders import TINY_TARGETS, VOCAB, assert_no_tensor_outlives, packed_row, stack_rows

DPACE = ("dpace", "dpace-cumulative-confidence-only", "dpace-continuation-value-only")


# --- the reference: the spec's formulas, written out --------------------------------------------


def reference_acceptance(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """LK's per-token acceptance ``sum_v min(P, softmax(logits))`` with the one-hot target P, float64."""
    draft = torch.softmax(logits.double(), dim=-1)
    return torch.minimum(torch.nn.functional.one_hot(labels, logits.shape[-1]).double(), draft).sum(-1)


def reference_dpace_weights(
    alpha: torch.Tensor, valid: torch.Tensor, groups: list[int], loss_type: str, dpace_alpha: float = 0.5
) -> torch.Tensor:
    """D-PACE's weights including the ``1 / A_doc`` of each block's document, float64 ``[M, D]``."""
    blocks, length = valid.shape
    counts = {g: 0 for g in groups}
    for m in range(blocks):
        counts[groups[m]] += int(valid[m].any())
    weights = torch.zeros(blocks, length, dtype=torch.float64)
    for m in range(blocks):
        prefix, running = [], 1.0
        for j in range(length):
            if valid[m, j]:
                running *= (1 - dpace_alpha) * float(alpha[m, j]) + dpace_alpha
            prefix.append(running)
        for j in range(length):
            if not valid[m, j]:
                continue
            suffix = sum(prefix[i] for i in range(j, length) if valid[m, i])
            weight = {
                "dpace": suffix,
                "dpace-cumulative-confidence-only": prefix[j],
                "dpace-continuation-value-only": suffix / prefix[j],
            }[loss_type]
            weights[m, j] = weight / counts[groups[m]]
    return weights


def reference_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    valid: torch.Tensor,
    groups: list[int],
    loss_type: str,
    gamma: float | None = 7.0,
    dpace_alpha: float = 0.5,
    kl_scale: float = 1.0,
    kl_decay: float = 1.0,
) -> torch.Tensor:
    """The loss of ``[M, D, V]`` logits. ``groups[m]`` names block m's document (D-PACE's unit)."""
    length = labels.shape[1]
    alpha = reference_acceptance(logits, labels)
    nll = -torch.log(alpha)
    supervised = valid.nonzero().tolist()
    if loss_type in DPACE:
        weights = reference_dpace_weights(alpha.detach(), valid, groups, loss_type, dpace_alpha)
        documents = len({groups[m] for m in range(valid.shape[0]) if valid[m].any()})
        return (weights * nll).sum() / max(1, documents)
    decay = [1.0 if gamma is None else math.exp(-j / gamma) for j in range(length)]
    denominator = sum(decay[j] for _, j in supervised) + 1e-6
    cross_entropy = sum(decay[j] * nll[m, j] for m, j in supervised) / denominator
    total_variation = sum(decay[j] * (1 - alpha[m, j]) for m, j in supervised) / denominator
    if loss_type in ("dflash", "lk-alpha"):
        return cross_entropy
    if loss_type == "lk-tv":
        return total_variation
    mean_alpha = sum(float(alpha[m, j].detach()) for m, j in supervised) / len(supervised)
    kappa = kl_scale * math.exp(-kl_decay * mean_alpha)
    return kappa * cross_entropy + (1 - kappa) * total_variation


def documents_of(packed, layout) -> list[int]:
    """Block m's document as (row, document in row), flattened to an int."""
    return (layout.rows * 100 + packed.doc_ids[layout.rows, layout.anchors]).tolist()


# --- objective level: random logits ----------------------------------------------------------------


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("known", ["anchor", "variable_prefix"])
def test_every_objective_equals_the_reference_on_random_logits(loss_type, known):
    packed_batch, _, anchors = holed_case()
    packed = validate_batch(packed_batch)
    layout = block_layout(packed, anchors, BLOCK)
    generator = torch.Generator().manual_seed(4)
    prefix = torch.ones_like(layout.anchors)
    if known == "variable_prefix":  # chains that run past their block's end
        prefix = torch.randint(1, BLOCK, layout.anchors.shape, generator=generator)
    targets = block_targets(packed, layout, prefix)
    valid = targets.valid
    assert not valid.all(dim=1).all() and not valid.any(dim=1).all()  # holes and an unsupervised block
    logits = (3.0 * torch.randn(*valid.shape, VOCAB, generator=generator)).requires_grad_()
    options = {"dpace_alpha": 0.3, "kl_scale": 0.8, "kl_decay": 2.0}
    expected = reference_loss(
        logits, targets.labels, valid, documents_of(packed, layout), loss_type, **options
    )
    (expected_grad,) = torch.autograd.grad(expected, logits)

    objective = BlockObjective(loss_type, **options)
    decay = decay_weights(valid.shape[1], 7.0)
    base, denominator = objective.base_weights(packed, layout, valid, decay)

    def terms(
        chunk_logits: torch.Tensor, labels: torch.Tensor, chunk_valid: torch.Tensor, chunk_base: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        result = objective.chunk_terms(nll_and_argmax(chunk_logits, labels)[0], chunk_valid, chunk_base)
        return (*result.sums, result.gold_probability_sum)

    for chunk in (None, 1, 3):
        *sums, gold = over_chunks(
            terms, chunk, [logits, targets.labels, valid, base], differentiable=objective.num_terms
        )
        loss = objective.loss(tuple(sums), gold, valid.sum(), denominator)
        (grad,) = torch.autograd.grad(loss, logits)
        torch.testing.assert_close(loss.double(), expected.detach(), rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(grad.double(), expected_grad.double(), rtol=1e-4, atol=1e-7)


def test_dpace_weights_hand_example():
    gold = torch.tensor([[0.6, 0.2, 1.0, 0.4]])
    valid = torch.tensor([[True, False, True, False]])  # a hole neither breaks nor extends the prefix
    # s = [0.8, 1, 1.0, 1] -> P = [0.8, 0.8, 0.8, 0.8]; suffix of P v = [1.6, 0.8, 0.8, 0]
    expected = {
        "dpace": [1.6, 0.0, 0.8, 0.0],
        "dpace-cumulative-confidence-only": [0.8, 0.0, 0.8, 0.0],
        "dpace-continuation-value-only": [2.0, 0.0, 1.0, 0.0],
    }
    for loss_type, weights in expected.items():
        torch.testing.assert_close(dpace_weights(gold, valid, 0.5, loss_type), torch.tensor([weights]))


def test_lk_alpha_is_the_default_cross_entropy_and_lk_lambda_mixes_by_mean_acceptance():
    objective = BlockObjective("lk-lambda", kl_scale=0.5, kl_decay=2.0)
    kappa = objective.kl_weight(torch.tensor(3.0), torch.tensor(4))
    assert kappa.item() == pytest.approx(0.5 * math.exp(-2.0 * 0.75))
    sums = (torch.tensor(2.0), torch.tensor(1.0))
    loss = objective.loss(sums, torch.tensor(3.0), torch.tensor(4), torch.tensor(2.0))
    assert loss.item() == pytest.approx((kappa.item() * 2.0 + (1 - kappa.item()) * 1.0) / 2.0)


# --- module level ----------------------------------------------------------------------------------


def make(cls=DFlashModule, **kwargs):
    kwargs.setdefault("mask_token_id", MASK_TOKEN)
    kwargs.setdefault("num_draft_layers", 2)
    kwargs.setdefault("block_size", BLOCK)
    kwargs.setdefault("num_anchors", 3)
    if cls is DFlash2Module:
        kwargs.setdefault("selector_rank", 8)
        kwargs.setdefault("selector_top_k", 5)
    module = cls(TINY_TARGETS["qwen3"], **kwargs)
    perturb(module)
    return module


def module_logits(module: DFlashModule, batch: dict, anchors: torch.Tensor):
    """The draft's chain logits (through its own forward), their targets and block documents."""
    packed = module.prepare_batch(batch)
    layout = block_layout(packed, anchors, BLOCK)
    known = torch.ones_like(layout.anchors)
    targets = block_targets(packed, layout, known)
    hidden = chain_hidden(module._draft_hidden(packed, layout, known), targets)
    return module._logits(hidden), targets, documents_of(packed, layout)


def assert_same_outputs(first, second) -> None:
    (a, grads_a), (b, grads_b) = first, second
    torch.testing.assert_close(a.loss, b.loss, rtol=1e-6, atol=1e-7)
    assert torch.equal(a.valid, b.valid) and torch.equal(a.correct, b.correct)
    assert grads_a.keys() == grads_b.keys()
    for name, grad in grads_b.items():
        scale = max(grad.abs().max().item(), 1e-6)
        torch.testing.assert_close(grads_a[name], grad, rtol=1e-5, atol=1e-5 * scale, msg=name)
    assert a.metrics.keys() == b.metrics.keys() and a.sums.keys() == b.sums.keys()
    for name in a.metrics:
        torch.testing.assert_close(a.metrics[name], b.metrics[name], rtol=1e-5, atol=1e-6)
    for name, (numerator, denominator) in a.sums.items():
        assert torch.equal(denominator, b.sums[name][1]), name
        torch.testing.assert_close(numerator, b.sums[name][0], rtol=1e-6, atol=0)


@pytest.mark.parametrize("cls", [DFlashModule, DFlash2Module], ids=["dflash", "dflash2"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_packed_equals_padded_and_the_module_loss_is_the_reference(cls, loss_type):
    module = make(cls, loss_type=loss_type, logits_chunk_blocks=2, loss_decay_gamma=4.0)
    packed, padded, anchors = holed_case()
    padded_anchors, _ = to_padded(module.prepare_batch(packed), anchors)
    packed_result = run(module, packed, anchors)
    assert_same_outputs(packed_result, run(module, padded, padded_anchors))

    output = packed_result[0]
    loss = output.metrics["base_loss"] if cls is DFlash2Module else output.loss
    with torch.no_grad():
        logits, targets, groups = module_logits(module, packed, anchors)
    expected = reference_loss(logits, targets.labels, targets.valid, groups, loss_type, gamma=4.0)
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-7)


# Tiny forwards, counted between steps: a second thread only adds synchronisation.
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("cls", [DFlashModule, DFlash2Module], ids=["dflash", "dflash2"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_no_tensor_outlives_a_training_step_under_any_objective(cls, loss_type):
    """Each objective leaves a different part of a chunk's graph undifferentiated (DFlash2's two sums,
    lk-lambda's CE and TV, the gold-token probability the others only read): none of it may outlive
    the step (DFlash2 once grew host memory by its log-probabilities every step, 26 MB at 64 anchors)."""
    module = make(cls, loss_type=loss_type, logits_chunk_blocks=2)
    packed, _, anchors = holed_case()
    assert_no_tensor_outlives(lambda: run(module, packed, anchors))


@pytest.mark.parametrize("loss_type", ["dpace", "lk-lambda"])
def test_a_row_level_unit_would_differ_between_the_layouts(loss_type):
    """What packed == padded guards against: D-PACE normalised per row (SpecForge's unit) or lk-lambda's
    kappa taken per row would change when the same blocks are packed two documents to a row; the
    per-document / per-micro-batch units do not."""
    packed_batch, padded_batch, anchors = holed_case()
    packed, padded = validate_batch(packed_batch), validate_batch(padded_batch)
    padded_anchors, _ = to_padded(packed, anchors)
    layouts = {
        "packed": block_layout(packed, anchors, BLOCK),
        "padded": block_layout(padded, padded_anchors, BLOCK),
    }
    batches = {"packed": packed, "padded": padded}
    targets = {
        name: block_targets(batches[name], layout, torch.ones_like(layout.anchors))
        for name, layout in layouts.items()
    }
    assert torch.equal(targets["packed"].labels, targets["padded"].labels)  # the same blocks, in order
    labels, valid = targets["packed"].labels, targets["packed"].valid
    logits = 3.0 * torch.randn(*valid.shape, VOCAB, generator=torch.Generator().manual_seed(5))
    objective = BlockObjective(loss_type)
    decay = decay_weights(BLOCK - 1, 7.0)
    values, per_row = {}, {}
    for name, layout in layouts.items():
        base, denominator = objective.base_weights(batches[name], layout, valid, decay)
        terms = objective.chunk_terms(nll_and_argmax(logits, labels)[0], valid, base)
        values[name] = objective.loss(terms.sums, terms.gold_probability_sum, valid.sum(), denominator)
        rows = layout.rows.tolist()
        if loss_type == "dpace":
            per_row[name] = reference_loss(logits, labels, valid, rows, loss_type)
        else:  # each row's own kappa, over the micro-batch's denominator
            share = (valid.float() * decay).sum(1)
            per_row[name] = sum(
                reference_loss(logits[mask], labels[mask], valid[mask], rows, loss_type)
                * share[mask].sum()
                / share.sum()
                for mask in (layout.rows == row for row in layout.rows.unique())
            )
    torch.testing.assert_close(values["packed"], values["padded"], rtol=1e-6, atol=0)
    if loss_type == "dpace":  # a padded row is one document: SpecForge's padded value is ours
        torch.testing.assert_close(per_row["padded"].float(), values["padded"], rtol=1e-5, atol=1e-7)
    assert abs(float(per_row["packed"]) - float(per_row["padded"])) > 1e-3


@pytest.mark.parametrize("cls", [DFlashModule, DFlash2Module], ids=["dflash", "dflash2"])
@pytest.mark.parametrize("loss_type", ["dpace-continuation-value-only", "lk-tv", "lk-lambda"])
def test_chunked_vocabulary_terms_equal_one_piece(cls, loss_type):
    packed, _, anchors = holed_case()
    one_piece = run(make(cls, loss_type=loss_type, logits_chunk_blocks=None), packed, anchors)
    chunked = run(make(cls, loss_type=loss_type, logits_chunk_blocks=3), packed, anchors)
    assert_same_outputs(chunked, one_piece)


def test_lk_alpha_trains_exactly_like_the_default():
    packed, _, anchors = holed_case()
    assert_same_outputs(run(make(loss_type="lk-alpha"), packed, anchors), run(make(), packed, anchors))


def test_dflash2_selector_loss_is_weighted_by_the_dpace_weights():
    module = make(DFlash2Module, loss_type="dpace", selector_top_k=48)
    packed_batch, _, anchors = holed_case()
    output = module.compute_loss(packed_batch, anchors=anchors)
    with torch.no_grad():
        logits, targets, groups = module_logits(module, packed_batch, anchors)
        packed = module.prepare_batch(packed_batch)
        layout = block_layout(packed, anchors, BLOCK)
        hidden = chain_hidden(module._draft_hidden(packed, layout, torch.ones_like(layout.anchors)), targets)
        values, candidates = logits.topk(48, dim=-1)
        predecessors = packed.input_ids[layout.rows[:, None], layout.block_row_positions()[:, :-1]]
        scores = module.draft.candidate_selector.scores(hidden, values, candidates, predecessors)
    hit = candidates == targets.labels[..., None]
    covered = hit.any(-1)
    assert covered[targets.valid].any() and not covered[targets.valid].all()
    ce = torch.nn.functional.cross_entropy(
        scores.double().flatten(0, 1), hit.long().argmax(-1).flatten(), reduction="none"
    ).view_as(covered)
    alpha = reference_acceptance(logits, targets.labels)
    weights = reference_dpace_weights(alpha, targets.valid, groups, "dpace") * covered
    expected = (ce * weights).sum() / (weights.sum() + 1e-6)
    torch.testing.assert_close(output.metrics["selector_loss"].double(), expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"loss_type": "dpace_p"}, r"loss_type 'dpace_p' is unknown; choose one of \('dflash', 'dpace'"),
        ({"loss_type": "DPACE"}, "loss_type 'DPACE' is unknown.*lk-lambda"),
        ({"dpace_alpha": -0.1}, r"dpace_alpha = -0.1 must be a number in \[0, 1\]"),
        ({"dpace_alpha": 1.5}, r"dpace_alpha = 1.5 must be a number in \[0, 1\]"),
        ({"dpace_alpha": float("nan")}, "dpace_alpha = nan"),
        ({"dpace_alpha": True}, "dpace_alpha = True"),
        ({"kl_scale": 1.2}, r"kl_scale = 1.2 must be a number in \[0, 1\]"),
        ({"kl_decay": -1.0}, "kl_decay = -1.0 must be a finite number >= 0"),
        ({"kl_decay": float("inf")}, "kl_decay = inf"),
    ],
)
@pytest.mark.parametrize("cls", [DFlashModule, DFlash2Module], ids=["dflash", "dflash2"])
def test_objective_options_are_checked_at_construction(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(TINY_TARGETS["qwen3"], mask_token_id=MASK_TOKEN, **kwargs)


# --- NeMo's block acceptance -------------------------------------------------------------------------


def test_accept_len_skip_holes_hand_example_and_where_it_differs_from_accept_len():
    valid = torch.tensor(
        [[1, 1, 1], [1, 0, 1], [0, 1, 1], [0, 0, 0], [1, 0, 0]], dtype=torch.bool
    )  # full, a hole, unsupervised first label, nothing supervised, cut short
    correct = torch.tensor([[1, 0, 1], [1, 0, 1], [0, 1, 0], [0, 0, 0], [1, 0, 0]], dtype=torch.bool)
    numerator, denominator = skip_holes_accept_sums(correct, valid)
    # accepted + 1 per counted chain: 1 + 1, 2 + 1 (the hole is skipped), 1 + 1, -, 1 + 1
    assert (numerator.item(), denominator.item()) == (9.0, 4.0)
    # The contract's tau_sim stops at the hole, drops the third chain, and divides position by position.
    assert acceptance_length(*prefix_counts(correct, valid)).item() == pytest.approx(1 + 3 / 3)

    full = torch.ones(6, 3, dtype=torch.bool)  # every chain fully supervised: the two agree
    hits = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 1, 1], [1, 1, 1], [0, 0, 0], [1, 1, 0]], dtype=torch.bool)
    numerator, denominator = skip_holes_accept_sums(hits, full)
    assert (numerator / denominator).item() == pytest.approx(
        acceptance_length(*prefix_counts(hits, full)).item()
    )


@pytest.mark.parametrize("cls", [DFlashModule, DFlash2Module], ids=["dflash", "dflash2"])
def test_accept_len_skip_holes_is_logged_as_an_exact_ratio_of_sums(cls):
    # Every candidate is an anchor (no draw: the same blocks each time); the second batch repeats one
    # token, which a few steps teach, so the two batches accept differently.
    module = make(cls, num_anchors=64, learning_rate=1e-2, warmup_ratio=0.0)
    easy = stack_rows([packed_row([torch.full((10,), 7), torch.full((12,), 7)], 24)])
    rows = [holed_case()[0], supervise_holes(easy, easy["position_ids"])]
    loader = torch.utils.data.DataLoader(rows, batch_size=None)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=12,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, loader)
    assert "train/accept_len_skip_holes" in trainer.callback_metrics
    (logged,) = trainer.validate(module, loader, verbose=False)
    with torch.no_grad():
        sums = [module.compute_loss(row).sums["accept_len_skip_holes"] for row in rows]
    expected = sum(n for n, _ in sums) / sum(d for _, d in sums)
    per_batch_mean = sum(n / d for n, d in sums) / len(sums)
    assert abs(float(expected) - float(per_batch_mean)) > 1e-3  # the two reductions tell apart
    assert logged["val/accept_len_skip_holes"] == pytest.approx(float(expected), rel=1e-6)
    assert logged["val/accept_len_skip_holes"] != pytest.approx(logged["val/accept_len"])


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_blocks_of_one_document_ignore_the_others_under_every_objective(loss_type):
    module = make(loss_type=loss_type)
    before, middle, after = documents([9, 12, 8], seed=5)

    def loss(docs: list[torch.Tensor]) -> DraftOutput:
        batch = stack_rows([packed_row(docs, 32)])
        return module.compute_loss(
            supervise_holes(batch, batch["position_ids"]), anchors=torch.tensor([[11, 13, 16]])
        )

    reference = loss([before, middle, after]).loss  # anchors only in the middle document (9..20)
    for other in (0, 2):
        changed = [before, middle, after]
        changed[other] = torch.flip(changed[other], [0])
        torch.testing.assert_close(loss(changed).loss, reference, rtol=0, atol=1e-6)
    assert not torch.allclose(loss([before, torch.flip(middle, [0]), after]).loss, reference)
