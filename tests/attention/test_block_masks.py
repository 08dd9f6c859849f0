"""The block-draft mask: equals a by-hand reference, flex mask_mod == dense SDPA form, never a NaN row."""

from __future__ import annotations

import pytest
import torch

from lightning_drafts.attention.anchors import sample_anchors
from lightning_drafts.attention.backends import attention_with_lse, dense_mask_from_mask_mod
from lightning_drafts.attention.block_masks import (
    block_layout,
    block_mask_mod,
    build_block_mask,
    dense_block_mask,
)
from lightning_drafts.core.batch import validate_batch
from tests.support.builders import packed_row, padded_rows, random_docs, stack_rows

BLOCK = 3
CPU = torch.device("cpu")


def example():
    """Two packed rows: short documents, a document of exactly one block, trailing pad folded into the
    last document of each row; anchors at a document start, overlapping, and at a document's end."""
    docs = random_docs([6, 2, 7, 3, 9])
    packed = validate_batch(stack_rows([packed_row(docs[:3], 18), packed_row(docs[3:], 18)]))
    anchors = torch.tensor([[0, 2, 3, 8, 8, 12], [0, 3, 4, 9, -1, -1]])
    return packed, anchors


def reference_mask(packed, anchors, block_size, window=None):
    """The rule of docs/concepts/dflash.md#block-attention written out with loops over row positions and
    documents."""
    batch, width = packed.shape
    context = [(b, t) for b in range(batch) for t in range(width) if packed.attention_mask[b, t]]
    blocks = [(b, int(a)) for b in range(batch) for a in anchors[b] if a >= 0]
    q_len, kv_len = len(blocks) * block_size, len(context) + len(blocks) * block_size
    mask = torch.zeros(q_len, kv_len, dtype=torch.bool)
    for m, (row, anchor) in enumerate(blocks):
        doc = packed.doc_ids[row, anchor]
        for offset in range(block_size):
            q = m * block_size + offset
            for kv, (key_row, position) in enumerate(context):
                visible = key_row == row and packed.doc_ids[key_row, position] == doc and position < anchor
                if window is not None:
                    visible = visible and (anchor + offset) - position < window
                mask[q, kv] = visible
            own = len(context) + m * block_size
            mask[q, own : own + block_size] = True
    return mask[None, None]


@pytest.mark.parametrize("window", [None, 1, 2, 4])
def test_dense_mask_equals_the_by_hand_reference(window):
    packed, anchors = example()
    layout = block_layout(packed, anchors, BLOCK)
    assert torch.equal(dense_block_mask(layout, window), reference_mask(packed, anchors, BLOCK, window))


@pytest.mark.parametrize("window", [None, 2])
def test_flex_mask_mod_materialises_to_the_dense_mask_including_pad_folding(window):
    packed, anchors = example()
    layout = block_layout(packed, anchors, BLOCK)
    flex = dense_mask_from_mask_mod(block_mask_mod(layout, window), 1, layout.q_len, layout.kv_len, CPU)
    assert torch.equal(flex, dense_block_mask(layout, window))
    # Padding is never a key: the context is exactly the real tokens of the micro-batch.
    assert layout.num_context == packed.real_tokens


def test_mask_mod_masks_and_survives_the_query_padding_flex_adds():
    packed, anchors = example()
    layout = block_layout(packed, anchors, BLOCK)
    mask_mod = block_mask_mod(layout, 2)
    q_idx = torch.arange(layout.q_len, layout.q_len + 130)[:, None]  # past the last block: clamped, masked
    kv_idx = torch.arange(layout.kv_len + 5)[None, :]
    zero = torch.zeros((), dtype=torch.long)
    assert not mask_mod(zero, zero, q_idx, kv_idx).any()


def test_no_query_row_is_fully_masked_and_the_window_narrows_only_the_context():
    packed, anchors = example()
    layout = block_layout(packed, anchors, BLOCK)
    full, narrow = dense_block_mask(layout), dense_block_mask(layout, 1)
    assert full.any(-1).all() and narrow.any(-1).all()
    assert not (narrow & ~full).any()
    context = layout.num_context
    assert torch.equal(full[..., context:], narrow[..., context:])
    assert not narrow[..., :context].any()  # window 1 leaves no context before the anchor
    # Two-way inside each block: every slot sees all slots of its block and no other block.
    blocks = full[0, 0, :, context:].view(layout.num_blocks, BLOCK, layout.num_blocks, BLOCK)
    eye = torch.eye(layout.num_blocks, dtype=torch.bool)[:, None, :, None].expand_as(blocks)
    assert torch.equal(blocks, eye)


def test_anchor_at_a_document_start_sees_no_context_and_overlapping_anchors_keep_their_own_slots():
    packed, anchors = example()
    layout = block_layout(packed, anchors, BLOCK)
    mask = dense_block_mask(layout)[0, 0]
    context = layout.num_context
    starts = packed.doc_start[layout.rows, layout.anchors] == layout.anchors
    per_query = starts.repeat_interleave(BLOCK)
    assert not mask[per_query, :context].any()
    # Blocks 3 and 4 share anchor 8: same context, disjoint block keys.
    assert torch.equal(mask[9:12, :context], mask[12:15, :context])
    assert not (mask[9:12, context:] & mask[12:15, context:]).any()


def test_packed_and_padded_layouts_see_the_same_context_per_block():
    docs = random_docs([6, 7, 5], seed=4)
    packed = validate_batch(packed_row(docs, 20))  # 2 pad slots folded into the last document
    padded = validate_batch(padded_rows(docs, 7))
    packed_anchors = torch.tensor([[1, 3, 6, 9, 13, 15]])
    padded_anchors = torch.tensor([[1, 3], [0, 3], [0, 2]])
    seen = []
    for batch, anchors in ((packed, packed_anchors), (padded, padded_anchors)):
        layout = block_layout(batch, anchors, BLOCK)
        mask = dense_block_mask(layout, 3)[0, 0, :, : layout.num_context]
        tokens = layout.gather_context(batch.input_ids)
        positions = layout.gather_context(batch.position_ids)
        seen.append([(tokens[row].tolist(), positions[row].tolist()) for row in mask])
    assert seen[0] == seen[1]


def test_block_positions_are_document_local_and_inputs_are_anchor_then_mask():
    packed, anchors = example()
    layout = block_layout(packed, anchors, BLOCK)
    positions = layout.block_position_ids(packed.position_ids)
    expected_start = packed.position_ids[layout.rows, layout.anchors]
    assert torch.equal(positions, expected_start[:, None] + torch.arange(BLOCK))
    assert positions[2].tolist() == [3, 4, 5]  # row 0, anchor 3 is offset 3 of document 0
    assert positions[3].tolist() == [0, 1, 2]  # row 0, anchor 8 starts document 2
    tokens = layout.block_input_ids(packed.input_ids, mask_token_id=95)
    assert torch.equal(tokens[:, 0], packed.input_ids[layout.rows, layout.anchors])
    assert (tokens[:, 1:] == 95).all()
    known = torch.full_like(layout.anchors, 2)
    tokens = layout.block_input_ids(packed.input_ids, mask_token_id=95, known=known)
    assert torch.equal(tokens[:, 1], packed.input_ids[layout.rows, layout.anchors + 1])
    assert (tokens[:, 2:] == 95).all()


def test_dense_and_flex_attention_agree_and_never_return_nan():
    docs = random_docs([8, 3, 12, 10], seed=2)
    packed = validate_batch(stack_rows([packed_row(docs[:2], 24), packed_row(docs[2:], 24)]))
    anchors = sample_anchors(packed, BLOCK, 4, generator=torch.Generator().manual_seed(0))
    layout = block_layout(packed, anchors, BLOCK)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, layout.q_len, 8, generator=gen)
    k, v = (torch.randn(1, 2, layout.kv_len, 8, generator=gen) for _ in range(2))
    dense, _ = attention_with_lse(q, k, v, build_block_mask(layout, "sdpa", 3), scale=0.35)
    flex, _ = attention_with_lse(q, k, v, build_block_mask(layout, "flex", 3), scale=0.35)
    assert torch.isfinite(dense).all()
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)
    reference = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=dense_block_mask(layout, 3), scale=0.35
    )
    torch.testing.assert_close(dense, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [0, -3, 2.5, True])
def test_bad_window_raises(window):
    packed, anchors = example()
    with pytest.raises(ValueError, match="sliding_window"):
        block_mask_mod(block_layout(packed, anchors, BLOCK), window)


def test_unknown_backend_raises():
    packed, anchors = example()
    with pytest.raises(ValueError, match="'flash'"):
        build_block_mask(block_layout(packed, anchors, BLOCK), "flash")
