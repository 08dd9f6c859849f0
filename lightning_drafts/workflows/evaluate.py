"""Evaluate an export by real greedy speculative decoding, whatever its family; sweep tree settings."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from lightning_drafts.registry import REGISTRY
from lightning_drafts.serving.draft_tree import TreeShape
from lightning_drafts.serving.evaluate import evaluate_family_export, resolve_target
from lightning_drafts.serving.export_files import read_export
from lightning_drafts.serving.report import EvaluationReport
from lightning_drafts.serving.tree_sweep import DEFAULT_SWEEP, SweepRow


def evaluate_export(
    export_dir: str | Path, prompts: Sequence[Tensor | Sequence[int]], **options: Any
) -> EvaluationReport:
    """Serve the export in ``export_dir`` on ``prompts`` through its registered family; ``options`` are
    those of :func:`~lightning_drafts.serving.evaluate.evaluate_family_export` (target, max_new_tokens,
    num_steps, stop_token_ids, with_training_estimate, check_lossless, engine, progress, ...)."""
    return evaluate_family_export(REGISTRY.for_export(export_dir), export_dir, prompts, **options)


def sweep_export(
    export_dir: str | Path,
    prompts: Sequence[Tensor | Sequence[int]],
    shapes: Sequence[TreeShape] = DEFAULT_SWEEP,
    **options: Any,
) -> list[SweepRow]:
    """Serve the export in ``export_dir`` on ``prompts`` once per tree setting of ``shapes`` (greedy, the
    built-in engine), with one target loaded once; ``options`` are :func:`evaluate_export`'s but
    ``num_steps``, ``topk`` and ``num_draft_tokens``, which each shape sets."""
    fixed = sorted({"num_steps", "topk", "num_draft_tokens"} & set(options))
    if fixed:
        raise ValueError(f"a sweep sets {fixed} per tree setting; drop them (or drop the sweep)")
    directory = Path(export_dir)
    target = resolve_target(
        options.pop("target", None),
        read_export(directory).config,
        directory,
        options.pop("target_seed", None),
        options.pop("target_attn_backend", "sdpa"),
        options.pop("target_dtype", None),
        options.pop("device", None),
    )
    options.setdefault("with_training_estimate", False)
    family = REGISTRY.for_export(directory)
    return [
        SweepRow.of(
            shape,
            evaluate_family_export(
                family,
                directory,
                prompts,
                target=target,
                num_steps=shape.num_steps,
                topk=shape.topk,
                num_draft_tokens=shape.num_draft_tokens,
                **options,
            ),
        )
        for shape in shapes
    ]
