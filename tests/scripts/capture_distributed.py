"""Capture tests.features' corpus for the EAGLE-3 draft of tests.features.test_capture on WORLD gloo
processes into DIR (every rank its own shards, rank 0 completing the manifest)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.features.feature_cases import DATA, WIDTH, corpus
from tests.features.test_capture import SMALL_SHARDS, eagle3


def capture_on(rank: int, world: int, directory: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{directory}.rendezvous", rank=rank, world_size=world)
    try:
        from lightning_drafts.workflows.capture import capture_documents

        torch.set_num_threads(1)
        summary = capture_documents(
            eagle3(),
            {"data_files": corpus()},
            directory,
            max_tokens=WIDTH,
            pad_token_id=0,
            data=DATA,
            dtype="float32",
            rows_per_batch=3,
            shard_bytes=SMALL_SHARDS,
        )
        assert summary.complete and summary.shards_written < summary.shards_total, summary
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    output, world = Path(sys.argv[1]), int(sys.argv[2])
    mp.spawn(capture_on, args=(world, output), nprocs=world)
