"""The frozen target's CPU attention: each document's span alone, causal, against SDPA run on it alone."""

from __future__ import annotations

import pytest
import torch

from lightning_drafts.training.document_target_attention import document_target_attention


def qkv(batch: int, width: int, heads: int = 4, kv_heads: int = 2, dim: int = 16, value_dim: int = 16):
    gen = torch.Generator().manual_seed(width)
    return (
        torch.randn(batch, heads, width, dim, generator=gen),
        torch.randn(batch, kv_heads, width, dim, generator=gen),
        torch.randn(batch, kv_heads, width, value_dim, generator=gen),
    )


def sdpa_alone(query, key, value, row: int, piece: slice, **mask) -> torch.Tensor:
    """PyTorch's SDPA (scale 0.3) on one span of one row alone, its two query heads per key head repeated."""
    return torch.nn.functional.scaled_dot_product_attention(
        query[row : row + 1, :, piece],
        key[row : row + 1, :, piece].repeat_interleave(2, dim=1),
        value[row : row + 1, :, piece].repeat_interleave(2, dim=1),
        scale=0.3,
        **mask,
    )


@pytest.mark.parametrize("value_dim", [16, 12])  # 12: MLA's value heads, narrower than the query heads
def test_each_span_attends_causally_to_itself_and_padding_gets_nothing(value_dim):
    query, key, value = qkv(2, 20, value_dim=value_dim)
    # Row 0: two documents then 3 padding slots; row 1: padding only.
    spans = ((0, 0, 9), (0, 9, 17))
    out, weights = document_target_attention(None, query, key, value, None, scaling=0.3, document_spans=spans)
    assert weights is None and out.shape == (2, 20, 4, value_dim)
    for row, start, stop in spans:
        piece = slice(start, stop)
        alone = sdpa_alone(query, key, value, row, piece, is_causal=True)
        torch.testing.assert_close(out[row, piece], alone[0].transpose(0, 1), atol=1e-6, rtol=1e-5)
    assert not out[0, 17:].any() and not out[1].any()


def test_spans_that_do_not_fit_the_batch_are_refused():
    query, key, value = qkv(1, 20)
    for spans in (((1, 0, 5),), ((0, 10, 40),)):
        with pytest.raises(ValueError, match="do not fit this layer's batch of 1 rows of 20 tokens"):
            document_target_attention(None, query, key, value, None, document_spans=spans)


@pytest.mark.parametrize(("name", "kind"), [("softcap", "logit soft-capping"), ("s_aux", "attention sinks")])
def test_a_layer_with_soft_capping_or_sinks_is_refused(name, kind):
    query, key, value_states = qkv(1, 8)
    with pytest.raises(
        ValueError, match=f"has no {kind}, which the target's layers apply.*attn_backend='eager'"
    ):
        document_target_attention(
            None, query, key, value_states, None, document_spans=((0, 0, 8),), **{name: torch.ones(4)}
        )


def test_a_sliding_window_applies_within_each_span_counted_from_its_start():
    query, key, value = qkv(1, 20)
    spans = ((0, 0, 9), (0, 9, 17))
    out, _ = document_target_attention(
        None, query, key, value, None, scaling=0.3, document_spans=spans, sliding_window=3
    )
    for row, start, stop in spans:
        piece, n = slice(start, stop), stop - start
        # Query i of the document sees its keys i - 2 .. i (transformers' window of 3: kv > q - 3).
        band = torch.tensor([[i - 3 < j <= i for j in range(n)] for i in range(n)])
        alone = sdpa_alone(query, key, value, row, piece, attn_mask=band)
        torch.testing.assert_close(out[row, piece], alone[0].transpose(0, 1), atol=1e-6, rtol=1e-5)
