"""``lightning-drafts plan``'s estimate of one quickstart training step against the step measured on the CPU.

Each (draft, width) runs ``benchmarks/context_step.py DRAFT WIDTH shipped`` in a fresh process with
``MALLOC_MMAP_THRESHOLD_=65536`` (glibc then maps every tensor of a micro-batch's size on its own, so the
resident set follows the live tensors; docs/guides/memory-plan.md), and prints the estimate, the measured
peak and the error, as a Markdown table.

    .venv/bin/python benchmarks/memory_plan_check.py
    .venv/bin/python benchmarks/memory_plan_check.py --drafts dflash --widths 8192
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_drafts.workflows.memory_plan import Plan, plan_config, read_config, target_config  # noqa: E402

MIB = 2**20
# What the step's data is (context_step.py): documents of 64-768 tokens, 416 on average, the first quarter
# of each unsupervised.
DOCUMENT_TOKENS, SUPERVISED = 416, 0.75


def cpu_plan(draft: str, width: int, documents: int | None = None) -> Plan:
    """The estimate of context_step.py's step: the quickstart config, float32 on the CPU, one row; with
    ``documents``, the row's documents (the step reports them) give its mean document length, else the
    data's mean (a row of a few documents holds more or fewer than the mean predicts)."""
    config = read_config(ROOT / "configs" / "quickstart" / f"{draft}.yaml")
    fields = target_config(config["model"]["init_args"]["target"], None)
    return plan_config(
        config,
        fields,
        devices=1,
        precision="32-true",
        rows=1,
        width=width,
        document_tokens=round(width / documents) if documents else DOCUMENT_TOKENS,
        supervised=SUPERVISED,
        cpu=True,
    )


def measured(draft: str, width: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, str(ROOT / "benchmarks" / "context_step.py"), draft, str(width), "shipped"]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, check=True)
    return json.loads(proc.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--drafts", nargs="+", default=["eagle3", "mla_eagle3", "dflash", "dflash2", "dspark"]
    )
    parser.add_argument("--widths", nargs="+", type=int, default=[1024, 2048, 4096, 8192, 16384, 32768])
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f} at the start")
    print("| draft | row width | documents | estimate MiB | measured MiB | error |")
    print("|---|---:|---:|---:|---:|---:|")
    for draft in args.drafts:
        for width in args.widths:
            step = measured(draft, width)
            estimate = cpu_plan(draft, width, step["documents"]).step_bytes
            error = estimate / step["peak_bytes"] - 1
            print(
                f"| {draft} | {width:,} | {step['documents']} | {estimate / MIB:,.0f} | "
                f"{step['peak_bytes'] / MIB:,.0f} | {error:+.1%} |",
                flush=True,
            )
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
