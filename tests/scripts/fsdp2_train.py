"""Train a draft with FSDP2 (ModelParallelStrategy, gloo, 2 CPU processes), save, then resume.

Usage: fsdp2_train.py OUT_DIR PHASE   (PHASE = "train" writes a checkpoint, "resume" continues it and
records the weights it started from)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy

from lightning_drafts.cli.process_group import end_process_group
from tests.support.builders import TINY_TARGETS, packed_row, random_docs, stack_rows
from tests.support.probe_draft import NextTokenProbe


def loader() -> torch.utils.data.DataLoader:
    rows = [stack_rows([packed_row(random_docs([5, 11], seed=i), 16)]) for i in range(8)]
    return torch.utils.data.DataLoader([{k: v[0] for k, v in r.items()} for r in rows], batch_size=1)


class StartWeights(L.Callback):
    """The draft's weights, whole, as the fit starts (after a resume: as loaded from the checkpoint)."""

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        # full_tensor is a collective: every rank gathers.
        self.weights = {name: p.full_tensor().tolist() for name, p in module.head.named_parameters()}
        self.weights = {f"head.{name}": value for name, value in self.weights.items()}


def main(out: Path, phase: str) -> None:
    module = NextTokenProbe(TINY_TARGETS["llama"], shard_target=True)
    strategy = ModelParallelStrategy(
        data_parallel_size=2,
        tensor_parallel_size=1,
        process_group_backend="gloo",
        save_distributed_checkpoint=False,
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=3 if phase == "train" else 5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    ckpt = out / "fsdp2.ckpt"
    start = StartWeights()
    trainer.callbacks.append(start)
    trainer.fit(module, loader(), ckpt_path=ckpt if phase == "resume" else None)
    # What the strategy gathers to rank 0 for a save (a collective: every rank calls it).
    gathered = sorted(k for k in trainer.strategy.lightning_module_state_dict() if k.startswith("target."))
    trainer.save_checkpoint(out / f"{phase}.ckpt")
    if trainer.is_global_zero:
        if phase == "train":
            (out / f"{phase}.ckpt").rename(ckpt)
        sharded = type(module.head.weight).__name__
        (out / f"{phase}.json").write_text(
            json.dumps(
                {"global_step": trainer.global_step, "param_type": sharded, "gathered_target": gathered}
                | ({"start": start.weights} if phase == "resume" else {})
            )
        )


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
    end_process_group()
