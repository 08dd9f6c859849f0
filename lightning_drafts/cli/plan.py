"""``lightning-drafts plan``: a fit config's peak GPU memory per rank, tokens per optimizer step and model
FLOPs per step, estimated from the config alone (no weight is loaded; docs/guides/memory-plan.md).

Examples::

    lightning-drafts plan --config configs/recipes/qwen3-8b_dflash.yaml \\
        --target-config benchmarks/recipe_targets/Qwen3-8B.json
    lightning-drafts plan --config configs/quickstart/dflash.yaml --accelerator cpu --precision 32-true \\
        --rows 1 --width 8192 --document-tokens 416 --supervised 0.75
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from lightning_drafts.cli.arguments import CommandParser

if TYPE_CHECKING:
    from lightning_drafts.workflows.memory_plan import Plan

GB = 1e9
# The options plan_config takes as they are parsed.
OVERRIDES = ("devices", "precision", "rows", "width", "document_tokens", "supervised", "coverage")
FITS_BELOW_GB = 70.0  # an 80 GB GPU, less the CUDA context, NCCL buffers and the allocator's fragmentation


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="lightning-drafts plan",
        description="Estimate a fit config's peak memory per rank, tokens per optimizer step and model FLOPs "
        "per step, building its target and draft on the meta device (nothing is loaded).",
    )
    parser.add_argument("--config", required=True, help="a fit config (configs/recipes/*.yaml)")
    parser.add_argument(
        "--target-config",
        default=None,
        help="the target's config.json (default: the config's target, from a local folder or the Hugging "
        "Face cache); benchmarks/recipe_targets/ holds the recipe targets'",
    )
    parser.add_argument("--devices", type=int, default=None, help="ranks (default: the trainer's devices)")
    parser.add_argument("--precision", default=None, help="e.g. bf16-mixed, 32-true (default: the trainer's)")
    parser.add_argument(
        "--accelerator",
        choices=("gpu", "cpu"),
        default=None,
        help="default: the trainer's (cpu: tiled attention)",
    )
    parser.add_argument("--rows", type=int, default=None, help="rows per micro-batch (default: batch_size)")
    parser.add_argument("--width", type=int, default=None, help="tokens per row (default: max_tokens)")
    parser.add_argument(
        "--document-tokens", type=int, default=1024, help="mean document length in tokens (default 1024)"
    )
    parser.add_argument(
        "--supervised",
        type=float,
        default=0.6,
        help="share of each document's tokens in the loss (default 0.6)",
    )
    parser.add_argument(
        "--coverage",
        type=float,
        default=1.0,
        help="EAGLE-3: share of supervised labels inside the draft vocabulary (default 1.0, the upper bound)",
    )
    return parser


def plan_main(args: list[str]) -> None:
    from lightning_drafts.workflows.memory_plan import plan_config, read_config, target_config

    parsed = build_parser().parse_args(args)
    if not 0 < parsed.supervised <= 1 or not 0 < parsed.coverage <= 1:
        raise ValueError(
            f"--supervised {parsed.supervised} / --coverage {parsed.coverage}: both are shares in (0, 1]; "
            "give e.g. --supervised 0.6 --coverage 1"
        )
    config = read_config(parsed.config)
    target = (config["model"].get("init_args") or {}).get("target")
    plan = plan_config(
        config,
        target_config(target, parsed.target_config),
        **{name: getattr(parsed, name) for name in OVERRIDES},
        cpu=None if parsed.accelerator is None else parsed.accelerator == "cpu",
    )
    print(render(plan))


def render(plan: Plan) -> str:
    """The plan as the lines ``plan`` prints."""
    s, w = plan.settings, plan.work
    lines = [
        f"{plan.family}: {s.devices} rank(s), {s.strategy}, {s.precision}; micro-batch {w.rows} x {w.width} "
        f"tokens, documents of {w.document_tokens} tokens, {w.supervised:.0%} supervised",
        "memory per rank (GB):",
    ]
    lines += [f"  {name:52} {value / GB:9.2f}" for name, value in plan.memory.items()]
    lines.append("  activations of one micro-batch (at the end of its forward):")
    lines += [f"    {name:50} {value / GB:9.2f}" for name, value in plan.activations.items()]
    verdict = "fits" if plan.peak / GB < FITS_BELOW_GB else "DOES NOT FIT"
    lines.append(f"  {'peak':52} {plan.peak / GB:9.2f}  ({verdict} an 80 GB GPU at {FITS_BELOW_GB:.0f} GB)")
    lines.append(f"tokens per optimizer step: {plan.tokens_per_step:,}")
    lines.append("model FLOPs per optimizer step (TFLOP):")
    lines += [f"  {name:52} {value / 1e12:9.1f}" for name, value in plan.flops.items()]
    lines.append(f"  {'total':52} {plan.total_flops / 1e12:9.1f}")
    lines += [f"note: {note}" for note in plan.notes]
    return "\n".join(lines)
