"""Block drafts' vocabulary terms at the supervised chain positions only, and only the blocks that have one
(``block_valid_only``, the default), against every position of every block (the reference,
``block_valid_only=False``): the same loss, every gradient and every statistic the module logs (chains,
valid tokens, acceptance counts, metrics, ratio sums) for DFlash, DFlash2 and DSpark, packed and padded,
with loss-mask holes, a block without any supervised position, a row of padding and (DFlash) a batch
whose chains are all unsupervised; and the skipped work is really not done.

Gradients are compared within fp32 round-off: ``rtol`` 1e-5 plus ``atol`` 1e-5 times the largest magnitude
of the reference gradient (a sum over fewer rows, the zero rows left out, may round differently).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from lightning_drafts import DFlash2Module, DFlashModule, DSparkModule
from lightning_drafts.attention.block_masks import block_layout
from lightning_drafts.core.chunked_terms import chunk_bounds
from lightning_drafts.core.draft_output import DraftOutput
from lightning_drafts.dspark.eval_mask import block_supervision
from lightning_drafts.training.module import DraftModule
from tests.families.dflash.cases import build as build_dflash
from tests.families.dspark.cases import build as build_dspark
from tests.support.block_draft_cases import BLOCK, holed_case, to_padded
from tests.support.builders import TINY_TARGETS
from tests.support.matmul_rows import RowsThrough
from tests.support.output_checks import assert_same_output

GRADIENT_RTOL, GRADIENT_SCALED_ATOL = 1e-5, 1e-5
TARGET = TINY_TARGETS["qwen3"]


def dflash(**options) -> DFlashModule:
    return build_dflash(DFlashModule, TARGET, **options)


def dflash2(**options) -> DFlash2Module:
    return build_dflash(DFlash2Module, TARGET, **options)


def dspark(**options) -> DSparkModule:
    return build_dspark(TARGET, **options)


# name -> (builder, options); chunked and one-piece terms both appear in every family.
MODULES: dict[str, tuple[Callable[..., DraftModule], dict]] = {
    "dflash": (dflash, {"logits_chunk_blocks": 2}),
    "dflash-one-piece-dpace": (dflash, {"logits_chunk_blocks": None, "loss_type": "dpace"}),
    "dflash-lk-lambda": (dflash, {"logits_chunk_blocks": 3, "loss_type": "lk-lambda"}),
    "dflash-variable-prefix-window": (
        dflash,
        {"variable_prefix": True, "sliding_window": 3, "loss_decay_gamma": None, "logits_chunk_blocks": 2},
    ),
    "dflash2": (dflash2, {"logits_chunk_blocks": 2}),
    "dflash2-one-piece-dpace": (dflash2, {"logits_chunk_blocks": None, "loss_type": "dpace"}),
    "dspark": (dspark, {"logits_chunk_blocks": 2}),
    "dspark-rnn-uniform-one-piece": (
        dspark,
        {"markov_head_type": "rnn", "loss_decay_gamma": None, "logits_chunk_blocks": None},
    ),
    "dspark-gated-trainable-lm-head": (
        dspark,
        {"markov_head_type": "gated", "freeze_embeddings": False, "logits_chunk_blocks": 3},
    ),
}


def pair(name: str) -> tuple[DraftModule, DraftModule]:
    """The module (skip on, the default) and its reference (skip off) with the same weights."""
    builder, options = MODULES[name]
    skip = builder(**options)
    every = builder(**options, block_valid_only=False)
    every.load_state_dict(skip.state_dict())
    assert skip.hparams.block_valid_only and not every.hparams.block_valid_only
    return skip, every


# --- batches: (batch, inputs of compute_loss) for a module ------------------------------------------------


def anchors_for(module: DraftModule, packed: dict, dflash_anchors: torch.Tensor) -> torch.Tensor:
    """The holed case's hand-placed anchors for DFlash (one of them has only unsupervised labels); DSpark's
    own sample on the same batch (its anchors follow another rule)."""
    if isinstance(module, DSparkModule):
        return module.sample_anchors(packed, generator=torch.Generator().manual_seed(0))
    return dflash_anchors


def inputs_for(module: DraftModule, anchors: torch.Tensor) -> dict[str, torch.Tensor]:
    inputs = {"anchors": anchors}
    if module.hparams.get("variable_prefix"):
        generator = torch.Generator().manual_seed(1)
        inputs["prefix_lengths"] = torch.randint(2, BLOCK, anchors.shape, generator=generator)
    return inputs


def packed_case(module: DraftModule) -> tuple[dict, dict]:
    packed, _, anchors = holed_case()
    return packed, inputs_for(module, anchors_for(module, packed, anchors))


def padded_case(module: DraftModule) -> tuple[dict, dict]:
    """The padded twin with the packed case's anchors (and prefix lengths) moved to it."""
    packed, inputs = packed_case(module)
    _, padded, _ = holed_case()
    anchors, prefix = to_padded(module.prepare_batch(packed), inputs["anchors"], inputs.get("prefix_lengths"))
    return padded, {"anchors": anchors} | ({} if prefix is None else {"prefix_lengths": prefix})


def padded_with_an_empty_row(module: DraftModule) -> tuple[dict, dict]:
    """The padded twin with a row of padding only (no real token, no anchor) in the middle."""
    padded, inputs = padded_case(module)
    batch = {k: torch.cat([v[:2], torch.zeros_like(v[:1]), v[2:]]) for k, v in padded.items()}
    spliced = {}
    for key, value in inputs.items():
        empty = torch.full_like(value[:1], -1 if key == "anchors" else 2)
        spliced[key] = torch.cat([value[:2], empty, value[2:]])
    return batch, spliced


def no_chain_supervised(module: DraftModule) -> tuple[dict, dict]:
    """The packed case's anchors at least a block apart, supervised at those anchors only: every chain
    position of every block is unsupervised."""
    packed, inputs = packed_case(module)
    anchors = inputs["anchors"].clone()
    for row in anchors:
        last = -BLOCK
        for slot, anchor in enumerate(row.tolist()):
            if anchor >= 0 and anchor - last < BLOCK:
                row[slot] = -1
            elif anchor >= 0:
                last = anchor
    loss_mask = torch.zeros_like(packed["loss_mask"])
    rows, slots = (anchors >= 0).nonzero(as_tuple=True)
    loss_mask[rows, anchors[rows, slots]] = 1
    return {**packed, "loss_mask": loss_mask}, {**inputs, "anchors": anchors}


BATCHES = {
    "packed": packed_case,
    "padded": padded_case,
    "padded-with-an-empty-row": padded_with_an_empty_row,
    "no-chain-supervised": no_chain_supervised,
}
# DSpark's anchor rule (the anchor and the next token supervised) makes every block's slot 0 supervised.
CASES = [
    (module, batch)
    for module in MODULES
    for batch in BATCHES
    if not (module.startswith("dspark") and batch == "no-chain-supervised")
]


# --- the comparison -------------------------------------------------------------------------------------


def run(module: DraftModule, batch: dict, inputs: dict) -> tuple[DraftOutput, dict[str, torch.Tensor | None]]:
    module.zero_grad(set_to_none=True)
    output = module.compute_loss(batch, **inputs)
    output.loss.backward()
    return output, {name: p.grad for name, p in module.named_parameters() if p.requires_grad}


def assert_same(first, second) -> None:
    (a, grads_a), (b, grads_b) = first, second
    assert_same_output(a, b)
    assert grads_a.keys() == grads_b.keys() and grads_b
    for name, grad in grads_b.items():
        assert (grads_a[name] is None) == (grad is None), name
        if grad is not None:
            scale = max(float(grad.abs().max()), 1e-6)
            torch.testing.assert_close(
                grads_a[name], grad, rtol=GRADIENT_RTOL, atol=GRADIENT_SCALED_ATOL * scale, msg=name
            )


@pytest.mark.parametrize("module_name, batch_name", CASES)
def test_skipping_unsupervised_positions_and_blocks_changes_no_loss_gradient_or_statistic(
    module_name, batch_name
):
    skip, every = pair(module_name)
    batch, inputs = BATCHES[batch_name](skip)
    result, reference = run(skip, batch, inputs), run(every, batch, inputs)
    output = reference[0]
    blocks = output.valid.shape[0]
    assert blocks > 0 and not output.valid.all()  # something to skip in every case
    if batch_name == "no-chain-supervised":
        assert not output.valid.any() and float(output.loss.detach()) == 0.0
    assert_same(result, reference)
    assert float(result[0].metrics["blocks"]) == blocks


@pytest.mark.parametrize("module_name", ["dflash", "dflash-variable-prefix-window", "dflash2"])
def test_the_holed_case_has_a_block_without_a_supervised_position(module_name):
    skip, _ = pair(module_name)
    batch, inputs = packed_case(skip)
    with torch.no_grad():
        valid = skip.compute_loss(batch, **inputs).valid
    assert (~valid.any(dim=1)).any() and valid.any(dim=1).any()


def test_every_dspark_block_has_its_first_slot_supervised():
    """So DSpark never leaves a block out: only positions."""
    module, _ = pair("dspark")
    for batch_name in ("packed", "padded", "padded-with-an-empty-row"):
        batch, inputs = BATCHES[batch_name](module)
        with torch.no_grad():
            valid = module.compute_loss(batch, **inputs).valid
        assert valid[:, 0].all() and not valid.all()


# --- the work is really skipped ---------------------------------------------------------------------------


def weights_of(module: DraftModule) -> dict[str, torch.Tensor]:
    """The vocabulary projections (each read once per kept position) and a draft layer's query projection
    (once per drafted block slot)."""
    weights = {"query": module.draft.layers[0].self_attn.q_proj.weight}
    if isinstance(module, DSparkModule):
        return {
            **weights,
            "draft head": module.draft.lm_head.weight,
            "markov": module.draft.markov_head.markov_w2.weight,
            "teacher head": module.target.lm_head.weight,
        }
    return {**weights, "head": module.target.lm_head.weight}


def distinct_per_chunk(
    module: DSparkModule, batch: dict, inputs: dict, among: torch.Tensor, what: str
) -> int:
    """Distinct teacher positions (row, anchor + k) or previous tokens (``what``) of the slots ``among``
    flags, counted per chunk of ``logits_chunk_blocks`` blocks (the remainder first), in layout order."""
    packed = module.prepare_batch(batch)
    layout = block_layout(packed, inputs["anchors"], module.block_size)
    if what == "previous":
        keys = block_supervision(packed, layout).previous
    else:
        width = packed.shape[1]
        positions = (layout.anchors[:, None] + torch.arange(module.block_size)).clamp(max=width - 1)
        keys = layout.rows[:, None] * width + positions
    bounds = chunk_bounds(layout.num_blocks, module.logits_chunk_blocks)
    return sum(
        int(keys[start:stop][among[start:stop]].unique().numel())
        for start, stop in zip(bounds[:-1], bounds[1:], strict=True)
    )


@pytest.mark.parametrize("module_name", ["dflash", "dflash-variable-prefix-window", "dflash2", "dspark"])
def test_vocabulary_rows_follow_the_supervised_positions_and_queries_the_kept_blocks(module_name):
    skip, every = pair(module_name)
    batch, inputs = packed_case(skip)
    counted = {}
    for name, module in (("skip", skip), ("every", every)):
        with RowsThrough(weights_of(module)) as rows:
            output, _ = run(module, batch, inputs)
        counted[name] = rows.rows
    valid = output.valid
    positions, supervised = valid.numel(), int(valid.sum())
    blocks, kept = valid.shape[0], int(valid.any(dim=1).sum())
    assert 0 < supervised < positions
    for weight, reference in counted["every"].items():
        if weight == "query":
            assert counted["skip"][weight] * blocks == reference * kept
        elif weight in ("teacher head", "markov"):
            # Once per distinct teacher position of a chunk (overlapping blocks share them), and the Markov
            # bigram row once per distinct previous token of a chunk, forward and backward.
            what, passes = ("position", 1) if weight == "teacher head" else ("previous", 2)
            every_slot = torch.ones_like(valid)
            for name, among in (("skip", valid), ("every", every_slot)):
                distinct = distinct_per_chunk(skip, batch, inputs, among, what)
                assert counted[name][weight] == passes * distinct, name
            assert 0 < counted["skip"][weight] < passes * supervised
        else:
            assert counted["skip"][weight] * positions == reference * supervised
            assert counted["skip"][weight] > 0
    if isinstance(skip, DSparkModule):
        assert kept == blocks
    else:
        assert kept < blocks


def test_the_flag_is_read_at_every_step():
    """The benchmark times both paths in one process by flipping ``hparams.block_valid_only``."""
    skip, every = pair("dflash")
    batch, inputs = packed_case(skip)
    expected = run(every, batch, inputs)
    skip.hparams.block_valid_only = False
    with RowsThrough(weights_of(skip)) as rows:
        flipped = run(skip, batch, inputs)
    with RowsThrough(weights_of(every)) as reference_rows:
        run(every, batch, inputs)
    assert rows.rows == reference_rows.rows
    assert_same(flipped, expected)


@pytest.mark.parametrize("module_class", [DFlashModule, DFlash2Module, DSparkModule])
def test_block_valid_only_must_be_a_bool(module_class):
    with pytest.raises(ValueError, match="block_valid_only = 1; it must be True or False"):
        module_class(TARGET, mask_token_id=1, block_valid_only=1)
