"""One training step of every draft on a 32k-token packed row, on the CPU, within a memory bound linear
in the row width.

Each draft is its quickstart config on the random tiny target of its shipped one (``benchmarks/tiny_targets.py``),
trained for one step (target forward, draft, loss, backward, AdamW) on one packed row of 32,768 tokens
in a fresh process (``benchmarks/context_step.py``), so the measured peak is the step's own. Each
bound is 1.5x the line ``peak = a + b * T`` that ``benchmarks/context_memory.py --targets tiny --widths
4096 8192 16384`` fitted to the same step at 4k-16k tokens, extended to 32k (docs/results/context-memory.md).
One term quadratic in the row width, a boolean ``[T, T]`` mask alone, is 1 GiB here and breaks every
bound.
"""

from __future__ import annotations

import json

import pytest

from tests.distributed.test_distributed import run_script

WIDTH = 32768
MIB = 2**20
# The measured line per draft: (a MiB, b MiB per 1k tokens).
FITTED = {
    "eagle3": (23.7, 21.28),
    "mla_eagle3": (20.2, 26.58),
    "dflash": (4.0, 34.02),
    "dflash2": (-26.5, 56.09),
    "dspark": (26.2, 29.59),
}
BOUND_MIB = {draft: 1.5 * (a + b * WIDTH / 1024) for draft, (a, b) in FITTED.items()}


@pytest.mark.parametrize("draft", sorted(BOUND_MIB))
def test_a_32k_token_row_trains_within_a_linear_memory_bound(draft):
    # The tests' one way to run a script (one thread, offline, under the hang guard).
    proc = run_script("benchmarks/context_step.py", draft, str(WIDTH), "tiny")
    step = json.loads(proc.stdout.strip().splitlines()[-1])
    assert step["width"] == WIDTH and step["documents"] > 100
    assert step["valid_tokens"] > 0
    # It trained: every trainable tensor got a finite gradient and AdamW moved it.
    assert step["finite_gradients"] and step["parameters_moved"] == step["parameters"]
    peak_mib = step["peak_bytes"] / MIB
    print(f"{draft}: {peak_mib:,.0f} MiB at {WIDTH:,} tokens (bound {BOUND_MIB[draft]:,.0f} MiB)")
    assert peak_mib <= BOUND_MIB[draft], (
        f"one {draft} step on a {WIDTH:,}-token packed row peaked at {peak_mib:,.0f} MiB, above its bound of "
        f"{BOUND_MIB[draft]:,.0f} MiB (1.5x the measured line extended to it): a term that grows "
        "faster than the row width is back; find it with benchmarks/context_memory.py --profile"
    )
