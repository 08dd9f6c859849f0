"""The block-wise row maximum and top-k against ``Tensor.max`` and ``Tensor.topk``."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_drafts.core.row_top import BLOCK, row_max, row_topk


@pytest.mark.parametrize("vocab", [BLOCK - 3, 3 * BLOCK, 3 * BLOCK + 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_max_is_max_over_the_last_dim_bit_for_bit(vocab, dtype):
    gen = torch.Generator().manual_seed(vocab)
    values = torch.randn(12, vocab, generator=gen).to(dtype)
    big = 100.0
    values[0, [5, vocab - 1]] = big  # tied across blocks: the first id
    values[1, [vocab - 2, vocab - 1]] = big  # tied at the end (inside the tail when there is one)
    values[2, [vocab // 2 + 1, vocab // 2 + 2]] = big  # tied inside one block
    values[3, vocab - 1] = big  # the maximum in the last column
    values[4, [3, vocab - 1]] = float("nan")  # a NaN is the maximum, the first one wins
    values[5, vocab - 1] = float("nan")
    values[6, :] = 0.0
    values[6, 2] = -0.0  # a signed zero ties with +0.0 and keeps its sign when first
    values[6, 1] = -0.0
    values[6, 0] = -1.0
    values[7, :] = float("-inf")
    top, index = row_max(values)
    expected_top, expected_index = values.max(dim=-1)
    assert torch.equal(index, expected_index)
    # Bit for bit, but for a NaN's sign and payload (max returns the canonical NaN, not the element's bits).
    torch.testing.assert_close(top, expected_top, rtol=0, atol=0, equal_nan=True)
    number = ~top.isnan()
    assert torch.equal(top[number].signbit(), expected_top[number].signbit())
    assert int(index[0]) == 5 and int(index[4]) == 3 and int(index[6]) == 1


@pytest.mark.parametrize("vocab", [3 * BLOCK, 20 * BLOCK + 5])
@pytest.mark.parametrize("k", [1, 3, 4, 16])  # 3 and 16 of 3 blocks: topk itself
def test_row_topk_is_topk_over_the_last_dim(vocab, k):
    gen = torch.Generator().manual_seed(vocab + k)
    values = torch.randn(10, vocab, generator=gen)
    # The largest entries crowded into one block, spread over many, and in the columns past the last block.
    values[0, BLOCK : BLOCK + 2 * k] = 50.0 + torch.arange(2 * k, dtype=torch.float32)
    values[1, torch.arange(k) * (vocab // k)] = 50.0 - torch.arange(k, dtype=torch.float32)
    values[2, vocab - min(k, 5) :] = 60.0 + torch.arange(min(k, 5), dtype=torch.float32)
    values[3, 7] = float("nan")
    top, ids = row_topk(values, k)
    expected_top, expected_ids = values.topk(k, dim=-1)
    torch.testing.assert_close(top, expected_top, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(ids, expected_ids)


def test_row_topk_ids_among_tied_values_name_entries_of_those_values():
    values = torch.zeros(3, 8 * BLOCK)
    values[:, [3, BLOCK + 1, 5 * BLOCK + 9, 7 * BLOCK]] = 2.0
    values[:, 6 * BLOCK + 4] = 3.0
    top, ids = row_topk(values, 3)
    assert torch.equal(top, values.topk(3, dim=-1).values)
    assert torch.equal(values.gather(1, ids), top)
    assert (ids[:, 0] == 6 * BLOCK + 4).all()
    assert all(len(set(row)) == 3 for row in ids.tolist())


@pytest.mark.parametrize("vocab", [2 * BLOCK, 7 * BLOCK + 1])
def test_a_strided_view_gives_max_and_topk_own_results(vocab):
    gen = torch.Generator().manual_seed(1)
    values = torch.randn(vocab, 9, generator=gen).t()  # rows of stride 1 apart, not contiguous
    top, index = row_max(values)
    assert torch.equal(index, values.max(dim=-1).indices) and torch.equal(top, values.max(dim=-1).values)
    top, ids = row_topk(values, 2)
    assert torch.equal(ids, values.topk(2, dim=-1).indices) and torch.equal(
        top, values.topk(2, dim=-1).values
    )


class OpNames(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_the_blocks_run_on_the_cpu_only():
    # Off the CPU max and topk are one kernel each, and the blocks would only add launches.
    for device, blocked in (("cpu", True), ("meta", False)):
        values = torch.empty(4, 8 * BLOCK, device=device)
        for reduce in (row_max, lambda v: row_topk(v, 2)):
            with OpNames() as ops:
                reduce(values)
            assert ("amax" in ops.names) == blocked, (device, ops.names)
