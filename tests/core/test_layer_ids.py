"""``target_layer_ids`` is one rule across the families (core/layer_ids.py), parametrised only by how many
ids a family reads and the lowest it can capture: the same bad list gets the same refusal everywhere."""

from __future__ import annotations

import pytest

from lightning_drafts.dflash.rules import TARGET_LAYER_IDS as DFLASH
from lightning_drafts.dspark.rules import TARGET_LAYER_IDS as DSPARK
from lightning_drafts.eagle3.rules import TARGET_LAYER_IDS as EAGLE3

RULES = {"eagle3": EAGLE3, "dflash": DFLASH, "dspark": DSPARK}


@pytest.mark.parametrize("family", sorted(RULES))
@pytest.mark.parametrize(
    ("ids", "match"),
    [
        ([5, 1, 3], r"^target_layer_ids = \[5, 1, 3\]; it must be strictly increasing \(\[1, 3, 5\]\)"),
        ([1, 1, 3], r"strictly increasing \(\[1, 3\]\)"),
        ([1, 2.5, 3], r"int ids \(offending: \[2\.5\]\)"),
        ([1, 3, 8], r"outside the target's 8 decoder layers \(offending: \[8\]"),
        ([-2, 1, 3], r"outside the target's 8 decoder layers \(offending: \[-2\]"),
        (None, r"^target_layer_ids = None; it must be"),
        ([], r"^target_layer_ids = \[\]; it must be"),
    ],
)
def test_every_family_refuses_the_same_bad_ids_the_same_way(family, ids, match):
    with pytest.raises(ValueError, match=match):
        RULES[family].check(ids, num_layers=8)


def test_the_families_differ_only_in_count_and_lowest_id():
    assert EAGLE3.problem([1, 3, 5], num_layers=8) is None
    assert "three distinct" in EAGLE3.problem([1, 3], num_layers=8)
    assert DFLASH.problem([1, 3], num_layers=8) is None
    # DSpark captures the embedding output (-1) and the final-norm output (L - 1); the others do not.
    assert DSPARK.problem([-1, 3, 7], num_layers=8) is None
    assert "offending: [-1]" in DFLASH.problem([-1, 3, 7], num_layers=8)
    assert "offending: [-1]" in EAGLE3.problem([-1, 3, 7], num_layers=8)
