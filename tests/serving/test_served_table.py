"""Both acceptance lengths users compare, on a hand-computed example where they differ: request A emits 10
tokens in 5 verify rounds (accepting 1 drafted token a round), request B 2 tokens in 2 rounds (accepting
none). Pooled over tokens (vLLM, SGLang): 12 / 7. Per-request mean (SpecForge): (10/5 + 2/2) / 2 = 1.5.
The table splits them by category and adds the set's overall row; tokens/s are tokens over seconds."""

from __future__ import annotations

import pytest

from lightning_drafts.serving.decode import Generation
from lightning_drafts.serving.report import served_acceptance
from lightning_drafts.serving.served_table import (
    ServedRequest,
    acceptance_by_position,
    acceptance_lengths,
    markdown_table,
    served_rows,
)

A_ROUNDS = [1, 1, 1, 1, 1]  # 5 rounds x (1 accepted + 1 emitted by the target) = 10 tokens
B_ROUNDS = [0, 0]  # 2 rounds x 1 token = 2 tokens
POOLED = 12 / 7
PER_REQUEST = (10 / 5 + 2 / 2) / 2


def test_pooled_and_per_request_acceptance_differ_as_computed_by_hand():
    assert acceptance_lengths([A_ROUNDS, B_ROUNDS]) == (pytest.approx(POOLED), pytest.approx(PER_REQUEST))
    # The evaluation report's served summary names both.
    generations = [Generation([0] * 10, A_ROUNDS, [2] * 5), Generation([0] * 2, B_ROUNDS, [2] * 2)]
    served = served_acceptance(generations, num_steps=2)
    assert served.accept_len == pytest.approx(POOLED)
    assert served.accept_len_per_request == pytest.approx(PER_REQUEST)
    # A request that never reached a verify round counts in neither.
    assert acceptance_lengths([A_ROUNDS, B_ROUNDS, []]) == acceptance_lengths([A_ROUNDS, B_ROUNDS])
    assert acceptance_lengths([[]]) == (None, None)


def test_acceptance_by_position_is_the_share_of_rounds_accepting_that_far():
    # Rounds accepting 2, 0, 1, 2 of 3 drafted tokens: position 1 reached by 3 of 4, 2 by 2, 3 by none.
    assert acceptance_by_position([[2, 0], [1, 2]], 3) == [0.75, 0.5, 0.0]


def test_the_table_has_a_row_per_category_and_one_for_the_set():
    requests = [
        # (prompt set, category, question, turn) as evaluate records them
        ServedRequest("mt-bench", "writing", "81", 1),
        ServedRequest("mt-bench", "math", "111", 1),
        ServedRequest("mt-bench", "math", "111", 2),
    ]
    accepted = [A_ROUNDS, B_ROUNDS, [3]]
    tokens = {"draft": [10, 2, 4], "target": [10, 2, 4]}
    seconds = {
        "draft": {("mt-bench", "writing"): 2.0, ("mt-bench", "math"): 1.0},
        "target": {("mt-bench", "writing"): 4.0, ("mt-bench", "math"): 3.0},
    }
    rows = served_rows(requests, accepted, tokens, seconds, num_steps=3)

    assert [(r.category, r.requests, r.output_tokens) for r in rows] == [
        ("writing", 1, 10),
        ("math", 2, 6),
        ("all", 3, 16),
    ]
    writing, math, overall = rows
    assert writing.accept_len_pooled == writing.accept_len_per_request == 2.0
    # math: B (2 tokens / 2 rounds) and one round accepting 3 (4 tokens / 1 round).
    assert math.accept_len_pooled == pytest.approx(6 / 3)
    assert math.accept_len_per_request == pytest.approx((1 + 4) / 2)
    assert overall.accept_len_pooled == pytest.approx(16 / 8)
    assert overall.accept_len_per_request == pytest.approx((2 + 1 + 4) / 3)
    assert math.tokens_per_s == {"draft": 6.0, "target": 2.0, "ngram": None} and math.speedup == 3.0
    assert overall.tokens_per_s["draft"] == pytest.approx(16 / 3)
    assert overall.speedup == pytest.approx((16 / 3) / (16 / 7))

    table = markdown_table(rows, "the built-in decode on CPU")
    assert "| mt-bench | math | 2 | 6 | 2.000 | 2.500 | 0.33, 0.33, 0.33 | 6.0 | 2.0 | - | 3.00 |" in table
    assert "accept_len pooled over tokens (vLLM, SGLang" in table and "per-request mean (SpecForge" in table
