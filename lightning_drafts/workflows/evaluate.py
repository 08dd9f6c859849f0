"""Evaluate an export by real greedy speculative decoding, whatever its family."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from lightning_drafts.registry import REGISTRY
from lightning_drafts.serving.evaluate import evaluate_family_export
from lightning_drafts.serving.report import EvaluationReport


def evaluate_export(
    export_dir: str | Path, prompts: Sequence[Tensor | Sequence[int]], **options: Any
) -> EvaluationReport:
    """Serve the export in ``export_dir`` on ``prompts`` through its registered family; ``options`` are
    those of :func:`~lightning_drafts.serving.evaluate.evaluate_family_export` (target, max_new_tokens,
    num_steps, stop_token_ids, with_training_estimate, check_lossless, engine, progress, ...)."""
    return evaluate_family_export(REGISTRY.for_export(export_dir), export_dir, prompts, **options)
