"""The warmup-cosine learning-rate schedule the reference recipes use
(docs/concepts/eagle3.md#learning-rate-schedule)."""

from __future__ import annotations

import math


def warmup_cosine(
    step: int, total_steps: int, warmup_ratio: float = 0.05, min_lr_ratio: float = 0.1
) -> float:
    """LR multiplier: linear warmup over ``max(1, warmup_ratio * total)`` steps, then cosine to ``min_lr_ratio``."""
    warmup = max(1, int(warmup_ratio * total_steps))
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, max(0.0, (step - warmup) / max(1, total_steps - warmup)))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
