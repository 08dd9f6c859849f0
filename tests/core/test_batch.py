"""The batch contract: derived metadata against hand-worked examples, and every fail-loud guard."""

from __future__ import annotations

import pytest
import torch

from lightning_drafts.core.batch import validate_batch, varlen_layout
from tests.support.builders import packed_row, random_docs, stack_rows


def nemo_example() -> dict[str, torch.Tensor]:
    """docs/concepts/eagle3.md#packing: T = 8, documents A(3), B(2) | C(7), trailing padding folded into the
    last document."""
    a, b, c = random_docs([3, 2, 7])
    return stack_rows([packed_row([a, b], 8), packed_row([c], 8)])


def test_derived_metadata_matches_the_worked_example():
    packed = validate_batch(nemo_example(), vocab_size=96)
    assert packed.seq_lens.tolist() == [[3, 5], [8, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6, 7]]
    assert packed.doc_remaining.tolist() == [[2, 1, 0, 1, 0, 0, 0, 0], [6, 5, 4, 3, 2, 1, 0, 0]]
    assert packed.doc_ids.tolist() == [[0, 0, 0, 1, 1, 1, 1, 1], [0] * 8]


def test_padded_batch_is_one_document_per_row():
    batch = {
        "input_ids": torch.tensor([[5, 6, 7, 0], [1, 2, 3, 4]]),
        "attention_mask": torch.tensor([[1, 1, 1, 0], [1] * 4]),
    }
    packed = validate_batch(batch)
    assert packed.seq_lens.tolist() == [[4], [4]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert packed.doc_remaining.tolist() == [[2, 1, 0, 0], [3, 2, 1, 0]]
    assert packed.loss_mask.tolist() == [[True, True, True, False], [True] * 4]


def test_zero_length_entries_never_split_a_document():
    batch = nemo_example()
    batch["seq_lens"] = torch.tensor([[3, 0, 5], [8, 0, 0]])
    packed = validate_batch(batch)
    assert packed.doc_remaining.tolist() == [[2, 1, 0, 1, 0, 0, 0, 0], [6, 5, 4, 3, 2, 1, 0, 0]]


def test_leading_zero_length_entries_give_document_ids_beyond_the_row_width():
    """Five empty entries before a 3-token document: its id is 5, past the row's 3 tokens."""
    packed = validate_batch(
        {
            "input_ids": torch.tensor([[5, 6, 7]]),
            "seq_lens": torch.tensor([[0, 0, 0, 0, 0, 3]]),
            "position_ids": torch.tensor([[0, 1, 2]]),
        }
    )
    assert packed.doc_ids.tolist() == [[5, 5, 5]]
    assert packed.doc_remaining.tolist() == [[2, 1, 0]]


def test_varlen_layout_flattens_real_tokens_per_document():
    layout = varlen_layout(validate_batch(nemo_example()))
    assert layout.cu_seqlens.tolist() == [0, 3, 5, 12]
    assert layout.cu_seqlens.dtype == torch.int32
    assert layout.max_seqlen == 7
    assert layout.token_index.tolist() == [0, 1, 2, 3, 4, 8, 9, 10, 11, 12, 13, 14]


def test_varlen_layout_leaves_out_documents_without_real_tokens():
    # Row 0: A(3), B(2) with the padding folded into it; row 1: C(7), one pad; row 2: an empty document
    # (a zero-length seq_lens entry), then D(2); row 3: E(2), then a document of padding alone.
    a, b, c, d, e = random_docs([3, 2, 7, 2, 2])
    batch = stack_rows([packed_row([a, b], 8), packed_row([c], 8), packed_row([d], 8), packed_row([e], 8)])
    batch["seq_lens"][2:] = torch.tensor([[0, 8], [2, 6]])
    layout = varlen_layout(validate_batch(batch))
    assert layout.token_index.tolist() == [0, 1, 2, 3, 4, *range(8, 15), 16, 17, 24, 25]
    assert layout.cu_seqlens.tolist() == [0, 3, 5, 12, 14, 16]
    assert layout.max_seqlen == 7


def test_given_doc_remaining_is_accepted_when_consistent():
    batch = nemo_example()
    given = torch.tensor([[2, 1, 0, 1, 0, 0, 0, 0], [6, 5, 4, 3, 2, 1, 0, 0]])
    batch["doc_remaining"] = given
    assert torch.equal(validate_batch(batch).doc_remaining, given)
    # One position off (the last token of A claims one more): refused, naming the position.
    batch["doc_remaining"] = given.clone().index_put_((torch.tensor([0]), torch.tensor([2])), torch.tensor(1))
    with pytest.raises(ValueError, match=r"doc_remaining\[0, 2\] = 1"):
        validate_batch(batch)


def with_change(key, value):
    batch = nemo_example()
    batch[key] = value(batch) if callable(value) else value
    return batch


def without(key):
    batch = nemo_example()
    del batch[key]
    return batch


BAD_BATCHES = {
    "missing input_ids": (without("input_ids"), "input_ids"),
    "empty batch": ({"input_ids": torch.zeros(0, 8, dtype=torch.long)}, "empty"),
    "input_ids rank": (with_change("input_ids", lambda b: b["input_ids"][0]), "input_ids.*2-D"),
    "input_ids dtype": (with_change("input_ids", lambda b: b["input_ids"].float()), "input_ids.*integers"),
    "attention_mask shape": (
        with_change("attention_mask", lambda b: b["attention_mask"][:, :4]),
        "attention_mask.*shape",
    ),
    "attention_mask values": (
        with_change("attention_mask", lambda b: b["attention_mask"] * 2),
        "attention_mask.*0 and 1",
    ),
    "attention_mask float": (
        with_change("attention_mask", lambda b: b["attention_mask"].float()),
        "attention_mask.*dtype",
    ),
    "all padding": (
        with_change("attention_mask", lambda b: torch.zeros_like(b["attention_mask"])),
        "no real token",
    ),
    "padding before a real token": (
        with_change("attention_mask", torch.tensor([[1, 1, 0, 1, 1, 0, 0, 0], [1] * 8])),
        "attention_mask row 0.*after padding",
    ),
    "loss_mask on padding": (
        with_change("loss_mask", torch.ones(2, 8, dtype=torch.long)),
        "loss_mask.*padding.*row 0, position 5",
    ),
    "token outside vocabulary": (
        with_change("input_ids", lambda b: b["input_ids"].index_fill(1, torch.tensor([2]), 96)),
        "input_ids\\[0, 2\\] = 96",
    ),
    "negative token": (
        with_change("input_ids", lambda b: b["input_ids"].index_fill(1, torch.tensor([1]), -1)),
        "input_ids\\[0, 1\\] = -1",
    ),
    "seq_lens without position_ids": (without("position_ids"), "seq_lens was given without position_ids"),
    "seq_lens rank": (with_change("seq_lens", torch.tensor([8, 8])), "seq_lens.*\\[B, D\\]"),
    "seq_lens dtype": (with_change("seq_lens", lambda b: b["seq_lens"].float()), "seq_lens.*integers"),
    "seq_lens row sum": (
        with_change("seq_lens", torch.tensor([[3, 4], [8, 0]])),
        "seq_lens'\\] row 0 = \\[3, 4\\] sums to 7",
    ),
    "seq_lens negative": (with_change("seq_lens", torch.tensor([[3, 5], [9, -1]])), "negative"),
    "position_ids not restarting": (
        with_change("position_ids", torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], list(range(8))])),
        "position_ids\\[0, 3\\] = 3.*offset 0",
    ),
    "position_ids dtype": (
        with_change("position_ids", lambda b: b["position_ids"].float()),
        "position_ids.*integers",
    ),
    "doc_remaining inconsistent": (
        with_change("doc_remaining", torch.zeros(2, 8, dtype=torch.long)),
        "doc_remaining\\[0, 0\\] = 0",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_BATCHES))
def test_bad_batches_raise_value_error_naming_the_key(case):
    batch, match = BAD_BATCHES[case]
    with pytest.raises(ValueError, match=match):
        validate_batch(batch, vocab_size=96)
