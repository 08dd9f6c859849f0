"""Validate the probe draft on 2 DDP CPU processes (gloo) and on 1, and write both metric dicts as JSON."""

from __future__ import annotations

import json
import sys

import lightning as L
import torch

from lightning_drafts.cli.process_group import end_process_group
from tests.support.builders import TINY_TARGETS, packed_row, random_docs, stack_rows
from tests.support.probe_draft import NextTokenProbe


def loader() -> torch.utils.data.DataLoader:
    rows = [stack_rows([packed_row(random_docs([3 + i, 9 - i], seed=i), 16)]) for i in range(8)]
    return torch.utils.data.DataLoader([{k: v[0] for k, v in r.items()} for r in rows], batch_size=1)


def validate(devices: int) -> dict[str, float]:
    torch.manual_seed(0)
    module = NextTokenProbe(TINY_TARGETS["llama"])
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    (metrics,) = trainer.validate(module, loader(), verbose=False)
    return {k: float(v) for k, v in metrics.items()} if trainer.is_global_zero else {}


if __name__ == "__main__":
    result = validate(int(sys.argv[2]))
    if result:
        with open(sys.argv[1], "w") as f:
            json.dump(result, f)
    end_process_group()
