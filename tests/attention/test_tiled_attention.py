"""Tiled masks: they stand for exactly the dense mask, and attention over them gives the dense values and
gradients, log-sum-exp included (EAGLE-3 merges its TTT diagonal through it)."""

from __future__ import annotations

import pytest
import torch

from lightning_drafts.attention.anchors import sample_anchors
from lightning_drafts.attention.backends import (
    attention_with_lse,
    block_causal_mask,
    mask_for_queries,
    masked_attention,
)
from lightning_drafts.attention.block_masks import block_layout, dense_block_mask, tiled_block_mask
from lightning_drafts.attention.kv_heads import expand_kv_heads
from lightning_drafts.attention.tiled import tile_dense_mask
from lightning_drafts.core.batch import validate_batch
from tests.support.builders import packed_row, random_docs, stack_rows
from tests.support.float_bounds import reduction_bound


def packed_doc_ids() -> torch.Tensor:
    docs = random_docs([5, 9, 6, 12, 3, 5], seed=3)
    batch = stack_rows([packed_row(docs[:3], 22), packed_row(docs[3:], 22)])
    return validate_batch(batch).doc_ids


def dense_and_tiled(mask: torch.Tensor, tiled, value_dim: int):
    gen = torch.Generator().manual_seed(0)
    batch, _, q_len, kv_len = mask.shape
    q = torch.randn(batch, 3, q_len, 8, generator=gen, requires_grad=True)
    k = torch.randn(batch, 3, kv_len, 8, generator=gen, requires_grad=True)
    v = torch.randn(batch, 3, kv_len, value_dim, generator=gen, requires_grad=True)
    out_grad = torch.randn(batch, 3, q_len, value_dim, generator=gen)
    lse_grad = torch.randn(batch, 3, q_len, generator=gen)
    results = []
    for form in (mask, tiled):
        out, lse = attention_with_lse(q, k, v, form, scale=0.4)
        # Rows that see nothing have lse = -inf by contract; they carry no gradient.
        objective = (out * out_grad).sum() + (lse.clamp(min=-1e4) * lse_grad).sum()
        results.append((out, lse, torch.autograd.grad(objective, (q, k, v))))
    return results


@pytest.mark.parametrize("tile_queries", [4, 7, 64])
@pytest.mark.parametrize("value_dim", [8, 5])
def test_tiled_block_causal_attention_matches_dense_values_and_gradients(tile_queries, value_dim):
    mask = block_causal_mask(packed_doc_ids())
    mask[1, 0, 6] = False  # a query that sees nothing
    tiled = tile_dense_mask(mask, tile_queries)
    assert torch.equal(tiled.dense(), mask)
    (dense_out, dense_lse, dense_grads), (out, lse, grads) = dense_and_tiled(mask, tiled, value_dim)
    torch.testing.assert_close(out, dense_out)
    torch.testing.assert_close(lse, dense_lse)
    assert torch.equal(out[1, :, 6], torch.zeros_like(out[1, :, 6])) and torch.isneginf(lse[1, :, 6]).all()
    for got, expected in zip(grads, dense_grads, strict=True):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, expected)


def test_tiles_keep_only_the_keys_their_queries_see():
    tiled = tile_dense_mask(block_causal_mask(packed_doc_ids()), 4)
    # Row 0's tile of queries 4..7 spans documents 0 and 1: keys 0..7, nothing after the tile's end.
    assert tiled.tiles[1].width <= 8
    assert sum(tile.width * (tile.stop - tile.start) for tile in tiled.tiles) < 22 * 22


@pytest.mark.parametrize("window", [None, 3])
def test_tiled_block_mask_is_the_dense_block_mask_and_attends_alike(window):
    docs = random_docs([40, 7, 30, 25], seed=5)
    packed = validate_batch(stack_rows([packed_row(docs[:2], 64), packed_row(docs[2:], 64)]))
    anchors = sample_anchors(packed, 4, 6, generator=torch.Generator().manual_seed(0))
    layout = block_layout(packed, anchors, 4)
    tiled = tiled_block_mask(layout, window)
    dense = dense_block_mask(layout, window)
    assert torch.equal(tiled.dense(), dense)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, layout.q_len, 8, generator=gen)
    k, v = (torch.randn(1, 2, layout.kv_len, 8, generator=gen) for _ in range(2))
    torch.testing.assert_close(masked_attention(q, k, v, tiled, 0.35), masked_attention(q, k, v, dense, 0.35))


def documents_of_many_sizes():
    """Block 4 (a tile holds at most 32 blocks, 128 queries): documents of 70, 1, 1, 7 and 10 blocks."""
    docs = random_docs([80, 10, 10, 12, 20], seed=2)
    packed = validate_batch(stack_rows([packed_row(docs[:1], 80), packed_row(docs[1:], 80)]))
    second_row = [2, 10 + 3, *(20 + a for a in range(7)), *(32 + a for a in range(10))]
    anchors = torch.full((2, 70), -1)
    anchors[0] = torch.arange(70)
    anchors[1, : len(second_row)] = torch.tensor(second_row)
    return block_layout(packed, anchors, 4)


def test_block_mask_tiles_hold_one_document_each_cut_evenly_and_small_documents_share_one():
    """The 70 blocks are cut into 24, 24 and 22; the documents of 1, 1 and 7 blocks (under a quarter tile
    each) share one tile; the one of 10 has its own."""
    layout = documents_of_many_sizes()
    tiled = tiled_block_mask(layout)
    assert [(tile.start // 4, tile.stop // 4) for tile in tiled.tiles] == [
        (0, 24),
        (24, 48),
        (48, 70),
        (70, 79),
        (79, 89),
    ]
    assert torch.equal(tiled.dense(), dense_block_mask(layout))


def test_a_query_selection_of_a_tiled_mask_is_the_dense_masks_rows():
    """Queries from some tiles, all of one tile, none of others (those tiles and their keys drop out)."""
    layout = documents_of_many_sizes()
    tiled, dense = tiled_block_mask(layout), dense_block_mask(layout)
    second, last = tiled.tiles[1], tiled.tiles[-1]
    chosen = torch.cat(
        [torch.tensor([1, 2, 5]), torch.arange(second.start, second.stop), torch.tensor([last.start + 3])]
    )
    for queries in (chosen, torch.arange(layout.q_len), torch.tensor([layout.q_len - 1])):
        selected = mask_for_queries(tiled, queries)
        assert torch.equal(selected.dense(), dense[:, :, queries]), queries
        assert torch.equal(mask_for_queries(dense, queries), dense[:, :, queries])
    kept = mask_for_queries(tiled, chosen).tiles
    assert [(tile.start, tile.stop) for tile in kept] == [
        (0, 3),
        (3, 3 + second.stop - second.start),
        (99, 100),
    ]


def gradient_term_sums(q, k, v, mask, scale, out_grad, lse_grad):
    """Per gradient of (q, k, v): how many products each element sums and their absolute sum, in float64 from
    the attention formulas (``dS = d objective / d scores``; ``dq = s dS k``, ``dk = s dS^T q`` and
    ``dv = P^T dO``, the key and value ones summed over each key/value head's query heads)."""
    groups = q.shape[1] // k.shape[1]
    q64, k64, v64 = (x.detach().double() for x in (q, k, v))
    k64, v64 = k64.repeat_interleave(groups, dim=1), v64.repeat_interleave(groups, dim=1)
    scores = (q64 @ k64.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf")).requires_grad_()
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1)).nan_to_num(0.0)
    objective = (probs @ v64 * out_grad.double()).sum() + (lse * lse_grad.double()).sum()
    (score_grad,) = torch.autograd.grad(objective, scores)
    score_grad, probs = score_grad.abs().detach(), probs.detach()

    def grouped(x):
        return x.unflatten(1, (k.shape[1], groups)).sum(2)

    kv_terms = groups * q.shape[2]
    return (
        (k.shape[2], scale * score_grad @ k64.abs()),
        (kv_terms, grouped(scale * score_grad.transpose(-1, -2) @ q64.abs())),
        (kv_terms, grouped(probs.transpose(-1, -2) @ out_grad.double().abs())),
    )


@pytest.mark.parametrize("form", ["tiled", "dense"])
def test_grouped_query_heads_attend_as_their_repeated_copies(form):
    """Six query heads over two key/value heads: query head h reads head h // 3, exactly what
    ``repeat_interleave`` copies give (the reference), in values, log-sum-exp and gradients."""
    layout = documents_of_many_sizes()
    mask = tiled_block_mask(layout) if form == "tiled" else dense_block_mask(layout)
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(1, 6, layout.q_len, 8, generator=gen, requires_grad=True)
    k = torch.randn(1, 2, layout.kv_len, 8, generator=gen, requires_grad=True)
    v = torch.randn(1, 2, layout.kv_len, 4, generator=gen, requires_grad=True)
    out_grad = torch.randn(1, 6, layout.q_len, 4, generator=gen)
    lse_grad = torch.randn(1, 6, layout.q_len, generator=gen)
    results = []
    for key, value in ((k, v), (k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1))):
        out, lse = attention_with_lse(q, key, value, mask, scale=0.4)
        objective = (out * out_grad).sum() + (lse * lse_grad).sum()
        results.append((out, lse, torch.autograd.grad(objective, (q, k, v))))
    (out, lse, grads), (ref_out, ref_lse, ref_grads) = results
    # Same kernel, same keys and values per query head: the forward is the same arithmetic on both sides.
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    # The key and value gradients sum the group's heads inside the kernel on one side and in
    # repeat_interleave's backward on the other: the same terms in another order, within the float bound.
    dense = dense_block_mask(layout)
    for name, grad, ref, (terms, magnitude) in zip(
        "qkv", grads, ref_grads, gradient_term_sums(q, k, v, dense, 0.4, out_grad, lse_grad), strict=True
    ):
        outside = (grad - ref).abs().double() > reduction_bound(terms, magnitude)
        assert not outside.any(), (
            f"d{name}: {int(outside.sum())} elements differ by more than the float bound"
        )
    torch.testing.assert_close(masked_attention(q, k, v, mask, 0.4), ref_out, rtol=0, atol=0)


def test_key_value_heads_that_do_not_divide_the_query_heads_are_refused():
    query, key = torch.zeros(1, 6, 3, 8), torch.zeros(1, 4, 5, 8)
    with pytest.raises(ValueError, match="6 query heads are not a multiple of 4 key/value heads"):
        expand_kv_heads(query, key, key)
