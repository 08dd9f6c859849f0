"""The block draft's last layer computed only where a needed slot's state depends on it: the states at the
needed slots equal the full computation's (values and gradients), for every mask form, with and without
DFlash2's in-block convolution (2 and 3 taps), and the queries and MLP rows really are only those the
dependency rule (written out below slot by slot) names."""

from __future__ import annotations

import pytest
import torch

from lightning_drafts.attention.anchors import sample_anchors
from lightning_drafts.attention.block_masks import block_layout, build_block_mask
from lightning_drafts.blockdraft.draft import BlockDraft, draft_config
from lightning_drafts.core.batch import validate_batch
from tests.support.builders import TINY_TARGETS, packed_row, random_docs, stack_rows
from tests.support.matmul_rows import RowsThrough

BLOCK = 8
FEATURES = 2
CONVS = {"no-conv": None, "conv-2-taps": (2, 4), "conv-3-taps": (3, 4)}


def draft(conv: tuple[int, int] | None) -> BlockDraft:
    """A two-layer draft of the tiny Qwen3 width with every weight drawn at random (the convolutions
    start as the identity, which reads no earlier slot, so they are moved off it)."""
    from transformers import AutoConfig

    torch.manual_seed(0)
    config = draft_config(AutoConfig.for_model(**TINY_TARGETS["qwen3"]), 2)
    module = BlockDraft(config, FEATURES, conv)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in module.parameters():
            parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator))
    return module


def inputs(module: BlockDraft, backend: str) -> tuple:
    """Three packed rows of six documents, anchors drawn in them (more block slots than one query tile of
    the CPU mask holds), random target features and slot inputs."""
    docs = random_docs([21, 9, 17, 25, 14, 30], seed=5)
    rows = [packed_row(docs[i : i + 2], 48) for i in range(0, 6, 2)]
    packed = validate_batch(stack_rows(rows))
    anchors = sample_anchors(packed, BLOCK, 8, torch.Generator().manual_seed(0))
    layout = block_layout(packed, anchors, BLOCK)
    hidden = module.config.hidden_size
    generator = torch.Generator().manual_seed(2)
    features = torch.randn(layout.num_context, FEATURES * hidden, generator=generator)
    embeddings = torch.randn(layout.num_blocks, BLOCK, hidden, generator=generator, requires_grad=True)
    mask = build_block_mask(layout, backend)
    # Several query tiles on the CPU path, so a selection maps queries of later tiles too.
    assert backend != "sdpa" or len(mask.tiles) > 1
    return (
        features,
        layout.gather_context(packed.position_ids),
        embeddings,
        layout.block_position_ids(packed.position_ids),
        mask,
    )


def needed_patterns(blocks: int) -> dict[str, torch.Tensor]:
    """A prefix per block (DSpark's eval mask), holes (DFlash's loss-mask holes), one slot late in a
    block with nothing needed before it, and nothing at all."""
    generator = torch.Generator().manual_seed(3)
    lengths = torch.randint(0, BLOCK + 1, (blocks,), generator=generator)
    prefix = torch.arange(BLOCK) < lengths[:, None]
    holes = torch.rand(blocks, BLOCK, generator=generator) < 0.4
    late = torch.zeros(blocks, BLOCK, dtype=torch.bool)
    late[1, BLOCK - 1] = late[2, 3] = True
    return {"prefix": prefix, "holes": holes, "late": late, "none": torch.zeros_like(late)}


def dependency_rows(needed: torch.Tensor, taps: int) -> tuple[set[int], set[int]]:
    """The flat slots whose queries and MLP inputs the last layer's output at ``needed`` reads, by walking
    the layer backwards one slot at a time: the output at t reads MLP outputs at t - j (j < taps) through
    the MLP's post-convolution; an MLP input at s reads states at s - j through its pre-convolution; a
    state at s reads attention outputs at s - j through the attention's post-convolution."""
    feed, states, attend = set(), set(), set()
    for block, slot in needed.nonzero().tolist():
        for mlp_slot in range(max(slot - taps + 1, 0), slot + 1):
            feed.add(block * BLOCK + mlp_slot)
            for state in range(max(mlp_slot - taps + 1, 0), mlp_slot + 1):
                states.add(block * BLOCK + state)
    for flat in states:
        block, state = divmod(flat, BLOCK)
        for query in range(max(state - taps + 1, 0), state + 1):
            attend.add(block * BLOCK + query)
    return attend, feed


@pytest.mark.parametrize("conv", CONVS)
@pytest.mark.parametrize("backend", ["sdpa", "eager"])
def test_needed_slots_equal_the_full_computation_in_value_and_gradient(conv, backend):
    module = draft(CONVS[conv])
    args = inputs(module, backend)
    embeddings = args[2]
    for name, needed in needed_patterns(embeddings.shape[0]).items():
        weights = (
            torch.randn(embeddings.shape, generator=torch.Generator().manual_seed(4)) * needed[..., None]
        )
        results = []
        for slots in (None, needed):
            module.zero_grad(set_to_none=True)
            embeddings.grad = None
            states = module(*args, needed=slots)
            (states * weights).sum().backward()
            grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
            results.append((states.detach()[needed], embeddings.grad.clone(), grads))
        (full, full_input_grad, full_grads), (part, part_input_grad, part_grads) = results
        torch.testing.assert_close(part, full, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(part_input_grad, full_input_grad, rtol=1e-5, atol=1e-6, msg=name)
        assert part_grads.keys() == full_grads.keys(), name
        for parameter, grad in full_grads.items():
            scale = max(float(grad.abs().max()), 1e-6)
            torch.testing.assert_close(
                part_grads[parameter], grad, rtol=1e-5, atol=1e-5 * scale, msg=parameter
            )


@pytest.mark.parametrize("conv", CONVS)
def test_needed_slots_under_a_flex_block_mask_equal_the_full_computation(conv):
    """Flex runs forward only on the CPU: values."""
    module = draft(CONVS[conv])
    args = inputs(module, "flex")
    with torch.no_grad():
        full = module(*args)
        for name, needed in needed_patterns(args[2].shape[0]).items():
            torch.testing.assert_close(
                module(*args, needed=needed)[needed], full[needed], rtol=1e-5, atol=1e-6, msg=name
            )


@pytest.mark.parametrize("conv", CONVS)
def test_the_last_layer_queries_and_feeds_only_the_slots_a_needed_state_depends_on(conv):
    module = draft(CONVS[conv])
    taps = 1 if CONVS[conv] is None else CONVS[conv][0]
    args = inputs(module, "sdpa")
    first, last = module.layers
    weights = {
        "first query": first.self_attn.q_proj.weight,
        "first mlp": first.mlp.gate_proj.weight,
        "last query": last.self_attn.q_proj.weight,
        "last output": last.self_attn.o_proj.weight,
        "last mlp": last.mlp.gate_proj.weight,
        "last key": last.self_attn.k_proj.weight,
    }
    slots = args[2].shape[0] * BLOCK
    context = args[0].shape[0]
    for name, needed in needed_patterns(args[2].shape[0]).items():
        if not needed.any():
            continue
        attend, feed = dependency_rows(needed, taps)
        with torch.no_grad(), RowsThrough(weights) as rows:
            module(*args, needed=needed)
        assert rows.rows == {
            "first query": slots,
            "first mlp": slots,
            "last query": len(attend),
            "last output": len(attend),
            "last mlp": len(feed),
            "last key": context + slots,
        }, name
        assert len(attend) < slots, name


def test_a_subset_layers_output_keeps_the_kernels_dtype_under_autocast():
    """Under bf16 autocast the attention and MLP outputs at the needed rows are bf16 while the layer's input
    (a float32 norm's output) is not: the spread into every slot keeps the rows' dtype. A float32 zero
    tensor there is refused by CUDA's ``index_copy`` (a bf16-mixed DFlash fit on CUDA stopped at its first
    step), while the CPU kernel accepts it."""
    from lightning_drafts.blockdraft.draft import _spread

    like = torch.randn(3, 4, 8)
    rows = torch.randn(5, 8).to(torch.bfloat16)
    index = torch.tensor([0, 3, 5, 6, 11])
    spread = _spread(rows, index, like)
    assert spread.dtype == torch.bfloat16 and spread.shape == like.shape
    expected = torch.zeros(12, 8, dtype=torch.bfloat16)
    expected[index] = rows
    assert torch.equal(spread.flatten(0, 1), expected)
