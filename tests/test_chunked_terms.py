"""Chunked, checkpointed vocabulary terms equal the one-piece computation, values and gradients."""

from __future__ import annotations

import pytest
import torch

from lightning_drafts.chunked_terms import chunk_bounds, over_chunks


def terms(features: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = features @ weight
    return torch.logsumexp(logits, -1).sum(), logits.argmax(-1)


@pytest.mark.parametrize(("blocks", "size"), [(7, 3), (6, 3), (5, 1), (4, 9), (1, 2)])
def test_chunks_cover_every_block_once_with_the_remainder_first(blocks: int, size: int):
    bounds = chunk_bounds(blocks, size)
    sizes = [stop - start for start, stop in zip(bounds[:-1], bounds[1:], strict=True)]
    assert bounds[0] == 0 and bounds[-1] == blocks and sum(sizes) == blocks
    assert all(s == size for s in sizes[1:]) and 0 < sizes[0] <= size


@pytest.mark.parametrize("size", [None, 1, 2, 3, 5, 8])
def test_chunked_terms_equal_one_piece_in_value_and_gradient(size: int | None):
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(7, 4, 6, generator=generator)
    weight = torch.randn(6, 11, generator=generator)

    def run(chunk_blocks: int | None):
        x, w = features.clone().requires_grad_(), weight.clone().requires_grad_()
        total, argmax = over_chunks(terms, chunk_blocks, x, w.expand(7, 6, 11))
        total.backward()
        return total.detach(), argmax, x.grad, w.grad

    reference, chunked = run(None), run(size)
    torch.testing.assert_close(chunked[0], reference[0])
    assert torch.equal(chunked[1], reference[1])
    torch.testing.assert_close(chunked[2], reference[2])
    torch.testing.assert_close(chunked[3], reference[3])
