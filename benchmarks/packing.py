"""Packing efficiency and packing speed on the embedded chitchat corpus, packed vs padded.

Efficiency is real tokens / token slots over one epoch; speed is real tokens per second for planning
one epoch and collating every micro-batch of it, pinned to one CPU core. The reference implementations'
method (next-fit in dataset order) is shown for comparison. Prints a markdown table.

    .venv/bin/python benchmarks/packing.py
"""

from __future__ import annotations

import argparse
import os
import time

import datasets
import numpy as np
import torch

from lightning_drafts.datamodules import PackedChatDataModule
from lightning_drafts.datamodules.documents import Documents
from lightning_drafts.datamodules.packing import collate, plan_epoch

MODES = {"buffer": "buffer-packed", "microbatch": "microbatch-packed", "padded": "padded"}


def next_fit_efficiency(lengths: np.ndarray, max_tokens: int) -> float:
    """NeMo / SpecForge packing: fill a row in order, start a new one when the next document does not fit."""
    rows, used = 1, 0
    for length in lengths.tolist():
        if used + length > max_tokens:
            rows, used = rows + 1, 0
        used += length
    return float(lengths.sum()) / (rows * max_tokens)


def measure(documents: Documents, mode: str, max_tokens: int, batch_size: int, repeats: int) -> dict:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        plan = plan_epoch(
            documents.lengths, mode=mode, max_tokens=max_tokens, batch_size=batch_size, seed=0, epoch=0
        )
        real = slots = 0
        for index in range(len(plan)):
            batch = collate(documents, plan, index, pad_token_id=0)
            slots += batch["input_ids"].numel()
            real += int(batch["attention_mask"].sum())
        best = min(best, time.perf_counter() - start)
    assert real == documents.num_tokens, "every document must be used exactly once"
    return {
        "micro_batches": len(plan),
        "rows": len(plan.row_bounds) - 1,
        "efficiency": real / slots,
        "tokens_per_s": real / best,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-tokens", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    datasets.disable_progress_bars()

    # A width no conversation reaches keeps the documents whole; each max_tokens truncates them below.
    corpus = PackedChatDataModule(max_tokens=1_000_000)
    corpus.setup()
    raw = corpus.train_documents
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
    torch.set_num_threads(1)

    print(
        f"Embedded corpus: {len(raw)} conversations, {raw.num_tokens} tokens before truncation; "
        "tokens/s = plan + collation of one epoch on one CPU core (best of "
        f"{args.repeats}).\n"
    )
    print(
        "| max_tokens | micro-batch | mode | truncated docs | micro-batches | rows | efficiency | tokens/s |"
    )
    print("|---:|---:|---|---:|---:|---:|---:|---:|")
    for max_tokens in args.max_tokens:
        documents, truncated, _ = raw.fit_to_width(max_tokens, "truncate")
        for batch_size in args.batch_sizes:
            for mode, label in MODES.items():
                result = measure(documents, mode, max_tokens, batch_size, args.repeats)
                print(
                    f"| {max_tokens} | {batch_size} | {label} | {truncated} | {result['micro_batches']} | "
                    f"{result['rows']} | {result['efficiency']:.2%} | {result['tokens_per_s'] / 1e6:.1f}M |"
                )
    print("\nReference, next-fit in dataset order (NeMo / SpecForge packing), efficiency of full rows:\n")
    print("| max_tokens | next-fit efficiency |")
    print("|---:|---:|")
    for max_tokens in args.max_tokens:
        documents, _, _ = raw.fit_to_width(max_tokens, "truncate")
        print(f"| {max_tokens} | {next_fit_efficiency(documents.lengths, max_tokens):.2%} |")


if __name__ == "__main__":
    main()
