"""Packing plans and collation on synthetic documents: contract, exactly-once, modes, ranks, epochs."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from lightning_drafts.core.batch import validate_batch
from lightning_drafts.datamodules.documents import Documents
from lightning_drafts.datamodules.packing import (
    MicroBatchPlan,
    best_fit_decreasing,
    collate,
    deal_micro_batches,
    plan_epoch,
    resolve_packing,
)

VOCAB = 10_000
MODES = ("buffer", "microbatch", "padded")


def synthetic_documents(count: int, seed: int = 0, max_length: int = 300) -> Documents:
    """Documents whose first token is ``1 + index``, so a batch tells which documents it holds."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_length, size=count)
    ids, masks = [], []
    for index, length in enumerate(lengths):
        tokens = rng.integers(count + 1, VOCAB, size=length)
        tokens[0] = index + 1
        ids.append(tokens)
        masks.append((rng.random(length) < 0.5).astype(np.int8))
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return Documents(
        np.concatenate(ids).astype(np.int32), np.concatenate(masks), starts, lengths.astype(np.int64)
    )


def documents_in_batch(batch: dict[str, torch.Tensor]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(token ids, loss mask) of every real document in a batch, read back through seq_lens."""
    found = []
    for row in range(batch["input_ids"].shape[0]):
        begin = 0
        for length in batch["seq_lens"][row].tolist():
            if length == 0:
                continue
            span = slice(begin, begin + length)
            real = batch["attention_mask"][row, span].bool()
            found.append(
                (
                    tuple(batch["input_ids"][row, span][real].tolist()),
                    tuple(batch["loss_mask"][row, span][real].tolist()),
                )
            )
            begin += length
    return found


def expected_documents(documents: Documents) -> Counter:
    return Counter(
        (tuple(ids.tolist()), tuple(mask.tolist()))
        for ids, mask in (documents.tokens(i) for i in range(len(documents)))
    )


def epoch_batches(documents: Documents, mode: str, **kwargs) -> list[dict[str, torch.Tensor]]:
    plan = plan_epoch(documents.lengths, mode=mode, **kwargs)
    return [collate(documents, plan, i, pad_token_id=0) for i in range(len(plan))]


def test_best_fit_decreasing_hand_example():
    # Longest first, each into the fullest bin that still fits: 5 -> new bin A (3 left); 4 -> new bin B
    # (4 left); 3 -> A (fullest that fits, 0 left); 3 -> B (1 left); 1 -> B (0 left).
    bins = best_fit_decreasing(np.array([5, 4, 3, 3, 1]), capacity=8)
    assert [sorted(b.tolist()) for b in bins] == [[0, 2], [1, 3, 4]]


def test_best_fit_decreasing_places_every_item_once_within_capacity():
    lengths = np.random.default_rng(1).integers(1, 700, size=2_000)
    bins = best_fit_decreasing(lengths, capacity=1024)
    placed = np.concatenate(bins)
    assert sorted(placed.tolist()) == list(range(len(lengths)))
    assert max(int(lengths[b].sum()) for b in bins) <= 1024
    assert lengths.sum() / (len(bins) * 1024) > 0.98
    with pytest.raises(ValueError, match="lengths in"):
        best_fit_decreasing(np.array([5, 9]), capacity=8)


def test_deal_micro_batches_hand_cases():
    assert deal_micro_batches(10, batch_size=4, world_size=1).tolist() == [[4], [4], [2]]
    assert deal_micro_batches(10, batch_size=2, world_size=2).tolist() == [[2, 2], [2, 2], [1, 1]]
    # A remainder smaller than the world size joins the previous step instead of starving a rank.
    assert deal_micro_batches(9, batch_size=2, world_size=2).tolist() == [[2, 2], [3, 2]]
    assert deal_micro_batches(3, batch_size=4, world_size=2).tolist() == [[2, 1]]
    with pytest.raises(ValueError, match="cannot give each of 4 ranks"):
        deal_micro_batches(3, batch_size=1, world_size=4)


def test_collate_matches_worked_example():
    # docs/concepts/eagle3.md#packing: T = 8, documents A(3), B(2), C(7); rows [A B] and [C].
    ids = np.array([11, 12, 13, 21, 22, 31, 32, 33, 34, 35, 36, 37], dtype=np.int32)
    mask = np.array([0, 1, 1, 0, 1, 0, 0, 1, 1, 1, 1, 1], dtype=np.int8)
    documents = Documents(ids, mask, np.array([0, 3, 5]), np.array([3, 2, 7]))
    plan = MicroBatchPlan.from_batches([[np.array([0, 1]), np.array([2])]], widths=[8])
    batch = collate(documents, plan, 0, pad_token_id=0)
    assert batch["input_ids"].tolist() == [[11, 12, 13, 21, 22, 0, 0, 0], [31, 32, 33, 34, 35, 36, 37, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1, 0, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1, 1, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6, 7]]
    assert batch["seq_lens"].tolist() == [[3, 5], [8, 0]]
    assert batch["doc_remaining"].tolist() == [[2, 1, 0, 1, 0, 0, 0, 0], [6, 5, 4, 3, 2, 1, 0, 0]]
    assert all(t.dtype == torch.long for t in batch.values())
    validate_batch(batch, vocab_size=100)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("batch_size", [1, 3])
def test_every_document_once_in_valid_batches(mode, batch_size):
    documents = synthetic_documents(200)
    batches = epoch_batches(documents, mode, max_tokens=512, batch_size=batch_size, seed=0, epoch=0)
    seen = Counter()
    for batch in batches:
        validate_batch(batch, vocab_size=VOCAB)
        if mode == "buffer":
            assert batch["input_ids"].shape[1] == 512
        seen.update(documents_in_batch(batch))
    assert seen == expected_documents(documents)


def test_modes_carry_the_same_real_tokens():
    documents = synthetic_documents(150, seed=3)
    totals = {}
    for mode in MODES:
        batches = epoch_batches(documents, mode, max_tokens=400, batch_size=4, seed=5, epoch=0)
        totals[mode] = (
            sum(int(b["attention_mask"].sum()) for b in batches),
            sum(int(b["loss_mask"].sum()) for b in batches),
        )
    assert totals["buffer"] == totals["microbatch"] == totals["padded"]
    assert totals["padded"] == (documents.num_tokens, int(documents.loss_mask.sum()))


def toy_loss(batch: dict[str, torch.Tensor]) -> float:
    """A masked mean over supervised tokens of a value that depends on the token and its document position,
    so it is layout-independent only if documents, masks and position_ids all survive packing."""
    packed = validate_batch(batch, vocab_size=VOCAB)
    value = ((packed.input_ids * (packed.position_ids + 1)) % 97).double()
    return float((value * packed.loss_mask).sum() / packed.loss_mask.sum())


def test_microbatch_packing_keeps_the_padded_micro_batches():
    documents = synthetic_documents(90, seed=4)
    padded = epoch_batches(documents, "padded", max_tokens=512, batch_size=4, seed=2, epoch=1)
    packed = epoch_batches(documents, "microbatch", max_tokens=512, batch_size=4, seed=2, epoch=1)
    assert len(packed) == len(padded)
    for step, (p, q) in enumerate(zip(packed, padded, strict=True)):
        assert Counter(documents_in_batch(p)) == Counter(documents_in_batch(q)), f"step {step}"
        # Same documents means the same supervised-token count, hence the same loss normalisation.
        assert int(p["loss_mask"].sum()) == int(q["loss_mask"].sum())
        assert toy_loss(p) == pytest.approx(toy_loss(q), rel=1e-12)
        assert p["input_ids"].shape[0] <= q["input_ids"].shape[0]
        assert q["input_ids"].shape[1] == int(q["attention_mask"].sum(1).max())


@pytest.mark.parametrize("mode", MODES)
def test_ranks_get_disjoint_batches_covering_all_documents(mode):
    documents = synthetic_documents(101, seed=6)
    per_rank = [
        epoch_batches(documents, mode, max_tokens=512, batch_size=2, seed=0, epoch=0, world_size=2, rank=rank)
        for rank in (0, 1)
    ]
    assert len(per_rank[0]) == len(per_rank[1])
    seen = [Counter(d for b in batches for d in documents_in_batch(b)) for batches in per_rank]
    assert not set(seen[0]) & set(seen[1])
    assert seen[0] + seen[1] == expected_documents(documents)


def test_plan_is_deterministic_per_epoch_and_reshuffled_across_epochs():
    lengths = synthetic_documents(300, seed=7).lengths
    kwargs = dict(mode="buffer", max_tokens=512, batch_size=2, seed=11)
    first = plan_epoch(lengths, epoch=0, **kwargs)
    again = plan_epoch(lengths, epoch=0, **kwargs)
    other_epoch = plan_epoch(lengths, epoch=1, **kwargs)
    other_seed = plan_epoch(lengths, epoch=0, **{**kwargs, "seed": 12})
    assert np.array_equal(first.docs, again.docs) and np.array_equal(first.row_bounds, again.row_bounds)
    assert not np.array_equal(first.docs, other_epoch.docs)
    assert not np.array_equal(first.docs, other_seed.docs)
    assert sorted(other_epoch.docs.tolist()) == list(range(300))


def test_small_shuffle_buffer_still_uses_every_document():
    documents = synthetic_documents(120, seed=8)
    batches = epoch_batches(
        documents, "buffer", max_tokens=512, batch_size=2, seed=0, epoch=0, shuffle_buffer=16
    )
    assert Counter(d for b in batches for d in documents_in_batch(b)) == expected_documents(documents)


def test_long_document_policies_count_and_apply():
    documents = synthetic_documents(50, seed=9, max_length=600)
    too_long = int((documents.lengths > 256).sum())
    assert too_long > 0
    truncated, count, dropped = documents.fit_to_width(256, "truncate")
    assert (count, dropped, len(truncated)) == (too_long, 0, 50)
    assert truncated.lengths.max() == 256
    kept, count, dropped = documents.fit_to_width(256, "drop")
    assert (count, dropped, len(kept)) == (0, too_long, 50 - too_long)
    for fitted in (truncated, kept):
        for batch in epoch_batches(fitted, "buffer", max_tokens=256, batch_size=2, seed=0, epoch=0):
            validate_batch(batch, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="long_documents='split'"):
        documents.fit_to_width(256, "split")


def test_resolve_packing():
    assert resolve_packing(True) == "buffer"
    assert resolve_packing(False) == "padded"
    assert resolve_packing("microbatch") == "microbatch"
    with pytest.raises(ValueError, match="packing='greedy'"):
        resolve_packing("greedy")


@pytest.mark.parametrize("mode", ["buffer", "microbatch", "padded"])
@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2), (2, 3), (3, 3)])
def test_an_epoch_resumed_on_another_world_size_uses_every_document_once(mode, before, after):
    lengths = synthetic_documents(97, seed=5).lengths
    kwargs = dict(mode=mode, max_tokens=512, batch_size=2, seed=3, epoch=1)
    plans = [plan_epoch(lengths, world_size=before, rank=r, **kwargs) for r in range(before)]
    steps = 4  # each rank ran its first 4 micro-batches, then the run stopped
    ran = [d for plan in plans for i in range(steps) for row in plan.batch_documents(i) for d in row.tolist()]
    consumed = int(plans[0].units_after[steps])
    assert all(int(plan.units_after[steps]) == consumed for plan in plans)
    rest = [plan_epoch(lengths, world_size=after, rank=r, start=consumed, **kwargs) for r in range(after)]
    resumed = [
        d for plan in rest for i in range(len(plan)) for row in plan.batch_documents(i) for d in row.tolist()
    ]
    assert len({len(plan) for plan in rest}) == 1  # every rank runs as many micro-batches (no hang)
    assert sorted(ran + resumed) == list(range(97))
    if before == after:
        for plan, resumed_plan in zip(plans, rest, strict=True):
            for i in range(len(resumed_plan)):
                got, want = resumed_plan.batch_documents(i), plan.batch_documents(steps + i)
                assert [r.tolist() for r in got] == [r.tolist() for r in want]
