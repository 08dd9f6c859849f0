"""Gradient clipping by norm through DraftModule.configure_gradient_clipping.

Lightning's precision plugin for ``FSDPStrategy`` refuses norm clipping, so the module clips under FSDP1
with the root FSDP module's ``clip_grad_norm_`` (proven on 2 processes in
tests/distributed/test_distributed.py); every other strategy clips through Lightning as before.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.plugins.precision import FSDPPrecision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from tests.support.builders import TINY_TARGETS, packed_row, random_docs, stack_rows
from tests.support.probe_draft import NextTokenProbe


def loader() -> torch.utils.data.DataLoader:
    rows = [stack_rows([packed_row(random_docs([5, 11], seed=i), 16)]) for i in range(2)]
    return torch.utils.data.DataLoader([{k: v[0] for k, v in r.items()} for r in rows], batch_size=1)


def test_the_fsdp1_precision_plugin_refuses_norm_clipping():
    """What FSDPStrategy's precision plugin does with the recipes' ``gradient_clip_val`` (the failure the
    module's hook exists for): it raises at the first optimizer step."""
    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    optimizer = torch.optim.AdamW([param])
    for precision in ("bf16-mixed", "bf16-true"):
        with pytest.raises(MisconfigurationException, match="not supported"):
            FSDPPrecision(precision).clip_gradients(optimizer, 1.0, GradClipAlgorithmType.NORM)


class ClippedNorms(L.Callback):
    """The total norm of the gradients the optimizer stepped with (after clipping): they stay on the
    parameters until the next step's ``zero_grad``."""

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        (optimizer,) = trainer.optimizers
        self.norms.append(total_norm(optimizer))


def total_norm(optimizer: torch.optim.Optimizer) -> float:
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))


@pytest.mark.parametrize("clip", [1e-3, None])
def test_the_module_clips_by_norm_on_a_single_device(tmp_path, clip):
    norms = ClippedNorms()
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=2,
        gradient_clip_val=clip,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[norms],
        default_root_dir=tmp_path,
    )
    trainer.fit(NextTokenProbe(TINY_TARGETS["llama"]), loader())
    assert len(norms.norms) == 2
    if clip is None:
        assert min(norms.norms) > 1e-2  # the unclipped norm is far above the clip value used above
    else:
        assert norms.norms == pytest.approx([clip, clip], rel=1e-4)
