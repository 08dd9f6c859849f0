"""One training step of the non-default objectives on 2 CPU processes (gloo); save the full gradients
and the validation metrics taken before the step.

Usage: objective_grads.py OUT_DIR STRATEGY   (STRATEGY = ddp | fsdp2)

Under FSDP2 (ModelParallelStrategy, target layers sharded, draft layers checkpointed) the block drafts
chunk their vocabulary terms two blocks at a time, so D-PACE's in-chunk weights and lk-lambda's two
separately differentiated sums (three with DFlash2's selector) meet FSDP2's unsharded weights; under
DDP they run in one piece. Every candidate is an anchor (no random draw), so both strategies see the
same blocks and must save the same gradients and metrics.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
from torch.distributed.tensor import DTensor

from benchmarks.two_process import strategy_of
from lightning_drafts import DFlash2Module, DFlashModule, Eagle3Module
from tests.scripts.distributed_grads import exit_after_the_last_collective, whole
from tests.support.block_draft_cases import BLOCK, MASK_TOKEN, documents
from tests.support.builders import TINY_TARGETS, packed_row, stack_rows

BLOCK_DRAFT = {"mask_token_id": MASK_TOKEN, "num_draft_layers": 2, "block_size": BLOCK, "num_anchors": 64}
DRAFTS = {
    "dflash-dpace": lambda chunk: DFlashModule(
        TINY_TARGETS["qwen3"], loss_type="dpace", logits_chunk_blocks=chunk, **BLOCK_DRAFT
    ),
    "dflash2-lk-lambda": lambda chunk: DFlash2Module(
        TINY_TARGETS["qwen3"],
        loss_type="lk-lambda",
        selector_rank=8,
        selector_top_k=4,
        logits_chunk_blocks=chunk,
        **BLOCK_DRAFT,
    ),
    "eagle3-lambda": lambda chunk: Eagle3Module(TINY_TARGETS["llama"], ttt_length=3, lk_loss_type="lambda"),
}


class SaveGradients(L.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_before_optimizer_step(
        self, trainer: L.Trainer, module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        # full_tensor is a collective: every rank takes part, rank 0 writes.
        grads = {name: whole(p.grad) for name, p in module.named_parameters() if p.grad is not None}
        sharded = isinstance(next(module.target.decoder_layers[0].parameters()), DTensor)
        if trainer.is_global_zero:
            torch.save({"grads": grads, "target_sharded": sharded}, self.out)


def rows() -> list[dict[str, torch.Tensor]]:
    """Two micro-batches of packed documents with a prompt and a hole each (one per rank)."""
    out = []
    for i, lengths in enumerate(([9, 8, 3], [12, 10])):
        row = stack_rows([packed_row(documents(lengths, seed=i), 24)])
        row["loss_mask"] = row["loss_mask"] * ~torch.isin(row["position_ids"], torch.tensor([0, 1, 5]))
        out.append({k: v[0] for k, v in row.items()})
    return out


def loader() -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(rows(), batch_size=1)


def build(draft: str, strategy: str) -> L.LightningModule:
    L.seed_everything(0)
    module = DRAFTS[draft](2 if strategy == "fsdp2" else None)
    module.hparams.shard_target = strategy == "fsdp2"
    module.hparams.activation_checkpointing = strategy == "fsdp2" and not draft.startswith("eagle3")
    with torch.no_grad():  # move the zero-initialised parts so every weight has a gradient
        for param in module.parameters():
            if param.requires_grad:
                param.add_(0.05 * torch.randn(param.shape))
    module.configure_model()
    return module


def run(out: Path, draft: str, strategy: str) -> None:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy_of(strategy),
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[SaveGradients(out / f"{draft}.pt")],
    )
    module = build(draft, strategy)
    (metrics,) = trainer.validate(module, loader(), verbose=False)
    if trainer.is_global_zero:
        (out / f"{draft}-val.json").write_text(json.dumps({k: float(v) for k, v in metrics.items()}))
    trainer.fit(module, loader())


if __name__ == "__main__":
    for name in DRAFTS:
        run(Path(sys.argv[1]), name, sys.argv[2])
    exit_after_the_last_collective()
