"""Anchors: every bound of docs/concepts/dflash.md#anchors, the per-document budget, packing invariance, the
DSpark option."""

from __future__ import annotations

import pytest
import torch

from lightning_drafts.attention.anchors import (
    anchor_candidates,
    anchors_from_positions,
    check_anchors,
    documents_shorter_than,
    flatten_anchors,
    sample_anchors,
)
from lightning_drafts.core.batch import validate_batch
from tests.support.block_draft_cases import with_prompts
from tests.support.builders import packed_row, padded_rows, random_docs, stack_rows

BLOCK = 4


def packed_batch(lengths_per_row: list[list[int]], width: int, seed: int = 0, prompt: int = 2):
    docs = random_docs([n for row in lengths_per_row for n in row], seed=seed)
    rows, start = [], 0
    for lengths in lengths_per_row:
        rows.append(packed_row(docs[start : start + len(lengths)], width))
        start += len(lengths)
    return validate_batch(with_prompts(stack_rows(rows), prompt)), docs


def test_candidates_by_hand_whole_blocks():
    # Row: doc A (5 tokens) | doc B (2 tokens, shorter than a block) | doc C (6 tokens) + 3 pad.
    packed, _ = packed_batch([[5, 2, 6]], width=16, prompt=1)
    expected = torch.tensor([[0, 1, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(anchor_candidates(packed, BLOCK), expected)


def test_candidates_by_hand_partial_blocks_for_dspark():
    # DSpark: anchor and next token supervised and in one document; a short document still counts.
    packed, _ = packed_batch([[5, 2, 6]], width=16, prompt=0)
    expected = torch.tensor([[1, 1, 1, 1, 0, 1, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(anchor_candidates(packed, BLOCK, partial_blocks=True), expected)


def assert_whole_block_bounds(packed, anchors, block_size):
    width = packed.shape[1]
    blocks = flatten_anchors(anchors)
    rows, pos = blocks.rows, blocks.positions
    assert (pos >= 0).all() and (pos <= width - block_size).all()  # a <= T - bs
    assert packed.loss_mask[rows, pos].all()  # the anchor is supervised
    last = pos + block_size - 1
    assert packed.attention_mask[rows, last].all()  # the whole block is real ...
    assert torch.equal(packed.doc_ids[rows, last], packed.doc_ids[rows, pos])  # ... and in one document
    assert (packed.doc_remaining[rows, pos] >= block_size - 1).all()


@pytest.mark.parametrize("seed", range(5))
def test_sampled_anchors_respect_every_bound_and_the_per_document_budget(seed):
    packed, _ = packed_batch([[9, 3, 14], [20, 6], [2, 11, 7]], width=28, seed=seed)
    num_anchors = 3
    generator = torch.Generator().manual_seed(seed)
    anchors = sample_anchors(packed, BLOCK, num_anchors, generator=generator)
    assert anchors.dtype == torch.long and anchors.shape[0] == 3
    assert_whole_block_bounds(packed, anchors, BLOCK)

    # Rows ascending, -1 only trailing, no duplicates.
    real = anchors >= 0
    assert torch.equal(real, real.cummin(dim=1).values)
    for row in range(anchors.shape[0]):
        kept = anchors[row][real[row]]
        assert torch.equal(kept, kept.sort().values) and kept.unique().numel() == kept.numel()

    # Per document: min(num_anchors, candidates of that document).
    candidates = anchor_candidates(packed, BLOCK)
    blocks = flatten_anchors(anchors)
    docs = packed.seq_lens.shape[1]
    got = torch.zeros(3, docs, dtype=torch.long).index_put_(
        (blocks.rows, packed.doc_ids[blocks.rows, blocks.positions]),
        torch.ones_like(blocks.rows),
        accumulate=True,
    )
    available = torch.zeros(3, docs, dtype=torch.long).scatter_add_(1, packed.doc_ids, candidates.long())
    assert torch.equal(got, available.clamp(max=num_anchors))
    assert (available > num_anchors).any()  # the budget binds somewhere, so the test can fail


def test_packed_documents_keep_the_budget_they_have_when_padded():
    lengths = [12, 9, 15]
    docs = random_docs(lengths, seed=3)
    packed = validate_batch(with_prompts(packed_row(docs, 40)))
    padded = validate_batch(with_prompts(padded_rows(docs, 15)))
    anchors = sample_anchors(packed, BLOCK, 4)[0]
    per_doc_packed = torch.bincount(packed.doc_ids[0, anchors[anchors >= 0]], minlength=3)
    per_doc_padded = (sample_anchors(padded, BLOCK, 4) >= 0).sum(1)
    assert torch.equal(per_doc_packed, per_doc_padded)
    assert per_doc_padded.tolist() == [4, 4, 4]
    # A per-row budget (NeMo) would have given the packed row only 4 anchors in total.
    assert int((anchors >= 0).sum()) == 12


def test_short_document_gives_no_anchor_and_is_counted():
    packed, _ = packed_batch([[3, 8], [2]], width=11, prompt=0)
    anchors = sample_anchors(packed, BLOCK, 10)
    assert (anchors[1] == -1).all()
    assert (anchors[0][anchors[0] >= 0] >= 3).all()  # nothing in the 3-token document
    assert int(documents_shorter_than(packed, BLOCK)) == 2


def test_no_candidate_anywhere_gives_an_empty_anchor_tensor():
    packed, _ = packed_batch([[3, 2], [3]], width=5, prompt=0)
    anchors = sample_anchors(packed, BLOCK, 8)
    assert anchors.shape == (2, 0)
    assert flatten_anchors(anchors).count == 0


def test_sampling_is_uniform_without_replacement():
    packed, _ = packed_batch([[12]], width=12, prompt=0)
    candidates = anchor_candidates(packed, BLOCK)[0].nonzero().squeeze(1)  # positions 0..8
    generator = torch.Generator().manual_seed(0)
    draws = torch.stack([sample_anchors(packed, BLOCK, 3, generator=generator)[0] for _ in range(900)])
    counts = torch.bincount(draws.flatten(), minlength=12)
    expected = 900 * 3 / candidates.numel()
    assert counts[candidates].float().sub(expected).abs().max() < 0.2 * expected
    assert counts[9:].sum() == 0


def test_generator_makes_sampling_deterministic():
    packed, _ = packed_batch([[9, 14], [20]], width=24)
    first = sample_anchors(packed, BLOCK, 2, generator=torch.Generator().manual_seed(7))
    again = sample_anchors(packed, BLOCK, 2, generator=torch.Generator().manual_seed(7))
    other = sample_anchors(packed, BLOCK, 2, generator=torch.Generator().manual_seed(8))
    assert torch.equal(first, again) and not torch.equal(first, other)


def test_partial_block_sampling_keeps_the_first_target_in_document():
    packed, _ = packed_batch([[5, 2, 6]], width=16, prompt=1)
    packed = validate_batch({**packed.to_dict(), "loss_mask": packed.attention_mask.clone()})
    anchors = sample_anchors(packed, BLOCK, 10, partial_blocks=True)
    blocks = flatten_anchors(anchors)
    rows, pos = blocks.rows, blocks.positions
    assert packed.loss_mask[rows, pos].all() and packed.loss_mask[rows, pos + 1].all()
    assert torch.equal(packed.doc_ids[rows, pos + 1], packed.doc_ids[rows, pos])
    assert set(pos.tolist()) == {0, 1, 2, 3, 5, 7, 8, 9, 10, 11}  # includes the 2-token document's anchor 5


def test_flatten_lays_blocks_back_to_back_without_padding_to_the_busiest_row():
    anchors = torch.tensor([[2, 5, 9, 11], [4, -1, -1, -1], [-1, -1, -1, -1]])
    blocks = flatten_anchors(anchors)
    assert blocks.rows.tolist() == [0, 0, 0, 0, 1]
    assert blocks.positions.tolist() == [2, 5, 9, 11, 4]
    assert blocks.slots.tolist() == [0, 1, 2, 3, 0]
    assert torch.equal(anchors_from_positions(blocks.rows, blocks.positions, 3), anchors)


@pytest.mark.parametrize(
    ("anchors", "match"),
    [
        (torch.tensor([[1, 2]]), r"\[B, N\] = \[2, N\]"),
        (torch.tensor([[1.0], [2.0]]), "integer"),
        (torch.tensor([[40], [-1]]), "outside the row"),
        (torch.tensor([[-2], [-1]]), "outside the row"),
        (torch.tensor([[0], [-1]]), "anchor 0 in row 0 is not a valid anchor"),  # a prompt token
        (torch.tensor([[-1], [18]]), "whole block"),  # the block would leave the document
    ],
)
def test_invalid_explicit_anchors_raise(anchors, match):
    packed, _ = packed_batch([[9, 14], [20]], width=24)
    with pytest.raises(ValueError, match=match):
        check_anchors(packed, anchors, BLOCK)


def test_valid_explicit_anchors_pass_and_may_overlap():
    packed, _ = packed_batch([[9, 14], [20]], width=24)
    anchors = check_anchors(packed, torch.tensor([[2, 2, 11], [5, -1, -1]], dtype=torch.int32), BLOCK)
    assert anchors.dtype == torch.long


@pytest.mark.parametrize(("block_size", "num_anchors"), [(0, 2), (4, 0), (4, True), (2.0, 2)])
def test_bad_sampling_arguments_raise(block_size, num_anchors):
    packed, _ = packed_batch([[9]], width=9)
    with pytest.raises(ValueError, match="must be a positive int"):
        sample_anchors(packed, block_size, num_anchors)
