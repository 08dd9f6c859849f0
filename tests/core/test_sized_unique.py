"""``torch.unique`` at a size known on the host: equal to ``torch.unique``, and the per-chunk counts that
size it equal each chunk's distinct values counted in Python."""

from __future__ import annotations

import pytest
import torch

from lightning_drafts.core.chunked_terms import chunk_bounds
from lightning_drafts.core.sized_unique import first_seen_per_chain, sorted_unique


@pytest.mark.parametrize("seed", range(20))
def test_sorted_unique_equals_torch_unique(seed):
    generator = torch.Generator().manual_seed(seed)
    values = torch.randint(
        0, 12, (int(torch.randint(0, 50, (1,), generator=generator)),), generator=generator
    )
    count = len(set(values.tolist()))
    distinct, inverse = sorted_unique(values, count)
    expected_distinct, expected_inverse = torch.unique(values, return_inverse=True)
    assert torch.equal(distinct, expected_distinct)
    assert torch.equal(inverse, expected_inverse)


@pytest.mark.parametrize("seed", range(20))
def test_each_chunk_s_first_seen_counts_sum_to_its_distinct_kept_values(seed):
    generator = torch.Generator().manual_seed(seed)
    chains = int(torch.randint(1, 15, (1,), generator=generator))
    values = torch.randint(0, 9, (chains, 4), generator=generator)
    kept = torch.rand(chains, 4, generator=generator) > 0.3
    bounds = chunk_bounds(chains, int(torch.randint(1, 6, (1,), generator=generator)))
    counts = first_seen_per_chain(values, kept, bounds, 9)
    for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
        seen = {
            v
            for row, keep in zip(values[start:stop].tolist(), kept[start:stop].tolist(), strict=True)
            for v, k in zip(row, keep, strict=True)
            if k
        }
        assert int(counts[start:stop].sum()) == len(seen)


def test_first_seen_counts_by_hand():
    # Chunks [0, 1) and [1, 3). Chain 0 sees 5 and 7; chain 1 sees 5 and 2, both new to its chunk; chain 2
    # sees 2 again and 9, and its 7 is left out.
    values = torch.tensor([[5, 7, 0], [5, 2, 0], [2, 9, 7]])
    kept = torch.tensor([[True, True, False], [True, True, False], [True, True, False]])
    assert first_seen_per_chain(values, kept, [0, 1, 3], 10).tolist() == [2, 2, 1]


def test_bounds_that_are_not_chunk_bounds_are_refused():
    values = torch.zeros(6, 2, dtype=torch.long)
    with pytest.raises(
        ValueError, match=r"chunk bounds \[0, 1, 2, 6\] are not a first chunk then chunks of one size"
    ):
        first_seen_per_chain(values, values > 0, [0, 1, 2, 6], 1)
