"""One training step of every draft on 2 CPU processes (gloo); save each draft's full gradients.

Usage: distributed_grads.py OUT_DIR STRATEGY   (STRATEGY = ddp | fsdp2 | fsdp1)

Writes ``OUT_DIR/{draft}.pt`` (the gradients, the weights they were taken at, the optimizer's settings and
whether the target's layers were sharded), the
validation metrics (not under FSDP1), the target tensors a save would gather (``{draft}-gathered.json``), the
target's LM head as built (``{draft}-target-head.pt``) and the
checkpoint after that step, and the weights a second step resumed from it starts from and its checkpoint. Under FSDP2
(ModelParallelStrategy: draft layers and root sharded, layers checkpointed, target layers sharded) the
block drafts also chunk their vocabulary terms (gradients taken inside forward, handed to the weights
FSDP2 unshards); under DDP they compute them in one piece. Same seeds and data, so the two strategies
must save the same gradients. Under FSDP1 (Lightning's ``FSDPStrategy``, the target's decoder layers
wrapped as the FSDP1 recipe wraps them, full state dicts) the drafts compute as under DDP. Every strategy
clips the gradients by norm (the recipes' ``gradient_clip_val``) to a value below their norm, so the
gradients saved are the clipped ones the optimizer stepped with.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import FSDPStrategy
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.tensor import DTensor

from benchmarks.two_process import trainer
from lightning_drafts import Eagle3Module
from lightning_drafts.cli.process_group import end_process_group
from lightning_drafts.dflash.dflash2_module import DFlash2Module
from lightning_drafts.dflash.module import DFlashModule
from lightning_drafts.dspark.module import DSparkModule
from lightning_drafts.eagle3.module import MLAEagle3Module
from tests.support.block_draft_cases import BLOCK, MASK_TOKEN, documents
from tests.support.builders import TINY_TARGETS, packed_row, stack_rows

EAGLE3 = ("eagle3", "mla_eagle3", "eagle3_frozen_head")
TIED_LLAMA = {**TINY_TARGETS["llama"], "tie_word_embeddings": True}
BLOCK_DRAFT = {"mask_token_id": MASK_TOKEN, "num_draft_layers": 2, "block_size": BLOCK, "num_anchors": 3}
DRAFTS = {
    "eagle3": lambda chunk: Eagle3Module(TINY_TARGETS["llama"], ttt_length=3),
    "mla_eagle3": lambda chunk: MLAEagle3Module(TINY_TARGETS["deepseek_v3"], ttt_length=3),
    # The LM head is the tied target's rows and frozen: a parameter without gradient in the draft's units.
    "eagle3_frozen_head": lambda chunk: Eagle3Module(
        TIED_LLAMA, ttt_length=3, lm_head_init="target", train_lm_head=False
    ),
    "dflash": lambda chunk: DFlashModule(TINY_TARGETS["qwen3"], logits_chunk_blocks=chunk, **BLOCK_DRAFT),
    "dflash2": lambda chunk: DFlash2Module(
        TINY_TARGETS["qwen3"], selector_rank=8, selector_top_k=4, logits_chunk_blocks=chunk, **BLOCK_DRAFT
    ),
    "dspark": lambda chunk: DSparkModule(
        TINY_TARGETS["qwen3"],
        markov_rank=8,
        freeze_embeddings=False,
        logits_chunk_blocks=chunk,
        **BLOCK_DRAFT,
    ),
}


class SaveGradients(L.Callback):
    """The weights before the step, and the gradients the optimizer stepped with: after clipping, they
    stay on the parameters until the next step's ``zero_grad``."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_before_backward(self, trainer, module, loss) -> None:
        # FSDP1 prefetches a unit in backward only if its forward marked it as needing a pre-backward
        # unshard (an output that requires grad): the target's units, run under no_grad, must not be.
        self.units_marked_for_backward = {
            "target": [
                layer._handle._needs_pre_backward_unshard
                for layer in module.target.decoder_layers
                if isinstance(layer, FSDP)
            ],
            "root": [
                unit._handle._needs_pre_backward_unshard
                for unit in FSDP.fsdp_modules(trainer.strategy.model)
                if unit._is_root and unit._handle is not None
            ],
        }

    def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
        self.weights = full_parameters(trainer, module, grads=False)
        (group,) = optimizer.param_groups
        # The step's own settings, so the test can apply AdamW's first step to these weights and gradients.
        self.adamw = {key: group[key] for key in ("lr", "betas", "eps", "weight_decay")}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        grads = full_parameters(trainer, module, grads=True)
        layer = module.target.decoder_layers[0]
        sharded = isinstance(layer, FSDP) or isinstance(next(layer.parameters()), DTensor)
        frozen = [
            n for n, p in module.named_parameters() if not p.requires_grad and not n.startswith("target.")
        ]
        frozen_sharded = [n for n, p in module.named_parameters() if n in frozen and isinstance(p, DTensor)]
        if trainer.is_global_zero:
            torch.save(
                {
                    "grads": grads,
                    "weights_before": {n: self.weights[n] for n in grads},
                    "adamw": self.adamw,
                    "target_sharded": sharded,
                    "units_marked_for_backward": getattr(self, "units_marked_for_backward", None),
                    "frozen_draft_parameters": frozen,
                    "frozen_draft_parameters_sharded": frozen_sharded,
                },
                self.out,
            )


class SaveWeightsAtStart(L.Callback):
    """The trainable weights a (resumed) fit starts from: those of the checkpoint it resumed."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_start(self, trainer, module) -> None:
        weights = full_parameters(trainer, module, grads=False)
        if trainer.is_global_zero:
            torch.save(weights, self.out)


def target_in_saves(trainer: L.Trainer) -> dict[str, list[str]]:
    """The target's tensors a save would gather: its keys in the strategy's state dict (a collective: every
    rank calls it), and under FSDP1 its parameters inside the root unit's flat parameter, which a full state
    dict unshards whatever keys the module's state dict then returns."""
    state = trainer.strategy.lightning_module_state_dict()
    flat = []
    if isinstance(trainer.strategy, FSDPStrategy):
        flat = [
            name for name in trainer.strategy.model._handle.flat_param._fqns if name.startswith("target.")
        ]
    return {"state_dict": sorted(k for k in state if k.startswith("target.")), "root_flat_parameter": flat}


def full_parameters(trainer: L.Trainer, module: L.LightningModule, grads: bool) -> dict[str, torch.Tensor]:
    """Every trainable parameter (or its gradient) whole, by its name in the module; collectives under
    FSDP1 and FSDP2, so every rank calls it."""
    if isinstance(trainer.strategy, FSDPStrategy):
        with FSDP.summon_full_params(trainer.strategy.model, with_grads=grads, writeback=False):
            return {
                n.replace("_fsdp_wrapped_module.", ""): (p.grad if grads else p).detach().clone()
                for n, p in module.named_parameters()
                if p.requires_grad and (p.grad is not None or not grads)
            }
    return {
        n: whole(p.grad if grads else p)
        for n, p in module.named_parameters()
        if p.requires_grad and (p.grad is not None or not grads)
    }


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """The full tensor of a (possibly FSDP2-sharded) parameter or gradient; a collective under FSDP2."""
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def loader() -> torch.utils.data.DataLoader:
    rows = [stack_rows([packed_row(documents([9, 8, 3], seed=i), 24)]) for i in range(2)]
    return torch.utils.data.DataLoader([{k: v[0] for k, v in r.items()} for r in rows], batch_size=1)


def build(draft: str, strategy: str) -> L.LightningModule:
    L.seed_everything(0)
    module = DRAFTS[draft](2 if strategy == "fsdp2" else None)
    # FSDP2 with every option on: target layers sharded, draft layers checkpointed (block drafts;
    # EAGLE-3 refuses checkpointing).
    module.hparams.shard_target = strategy == "fsdp2"
    module.hparams.activation_checkpointing = strategy == "fsdp2" and draft not in EAGLE3
    with torch.no_grad():  # move the zero-initialised parts so every weight has a gradient
        for param in module.parameters():
            if param.requires_grad:
                param.add_(0.05 * torch.randn(param.shape))
    # As load_from_checkpoint or an earlier single-device run would: the strategy must still shard it.
    module.configure_model()
    return module


def step_save_resume(out: Path, draft: str, strategy: str) -> None:
    """One step (gradients saved), validation of the stepped draft (``{draft}-val.json``), a checkpoint
    (``{draft}.ckpt``), then a resumed second step (``{draft}-resumed.ckpt``)."""
    first = trainer(strategy, 1, [SaveGradients(out / f"{draft}.pt")])
    module = build(draft, strategy)
    target_head = module.target.lm_head.weight.detach().clone()  # before any strategy wraps it
    first.fit(module, loader())
    gathered = target_in_saves(first)
    if first.is_global_zero:
        (out / f"{draft}-gathered.json").write_text(json.dumps(gathered))
        torch.save(target_head, out / f"{draft}-target-head.pt")
    # FSDPStrategy cannot validate a module a finished fit left wrapped (its root's parameters stay empty
    # shards and Lightning wraps only a module without FSDP units): FSDP1 validates inside fit.
    if strategy != "fsdp1":
        L.seed_everything(1)  # the seed of validation's anchors, the same under both strategies
        (metrics,) = first.validate(module, loader(), verbose=False)
        if first.is_global_zero:
            (out / f"{draft}-val.json").write_text(json.dumps({k: float(v) for k, v in metrics.items()}))
    first.save_checkpoint(out / f"{draft}.ckpt")
    second = trainer(strategy, 2, [SaveWeightsAtStart(out / f"{draft}-resumed-start.pt")])
    second.fit(build(draft, strategy), loader(), ckpt_path=out / f"{draft}.ckpt")
    second.save_checkpoint(out / f"{draft}-resumed.ckpt")


def exit_after_the_last_collective() -> None:
    """Leave a finished 2-rank script: both ranks past their last collective before either tears gloo down,
    then out without the interpreter's teardown (every result is written by then), where gloo's threads
    have aborted a finished FSDP2 process now and then ("terminate called without an active exception",
    exit status -6)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
    end_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    for name in DRAFTS:
        step_save_resume(Path(sys.argv[1]), name, sys.argv[2])
    exit_after_the_last_collective()
