"""The probe family's conformance case."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.families.dflash.cases import training_batch
from tests.families.eagle3.cases import sharpened_target
from tests.families.family_case import FamilyCase
from tests.families.probe.module import ProbeDraft
from tests.support.builders import VOCAB

QUICKSTART = Path(__file__).with_name("quickstart.yaml")


def build(target, **options) -> ProbeDraft:
    torch.manual_seed(0)
    return ProbeDraft(target, **options)


def trained(kind: str, steps: int = 4) -> ProbeDraft:
    module = build(sharpened_target(kind))
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        module.compute_loss(training_batch()).loss.backward()
        optimizer.step()
    return module


CASES = {
    ProbeDraft: FamilyCase(
        module_class=ProbeDraft,
        targets=("llama", "qwen3", "deepseek_v3"),
        build=build,
        trained=trained,
        num_steps=lambda module: 1,
        quickstart=QUICKSTART,
        required_tensor="head.weight",
        position_logits=lambda module, batch: module.position_logits(batch),
        details={"vocab_size": VOCAB},
    )
}
