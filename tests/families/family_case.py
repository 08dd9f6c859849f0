"""The record the conformance suite (tests/families/test_conformance.py) reads for each module class:
how to build a tiny one, what to feed its ``compute_loss``, how to train one far enough that its exports
pass validation, and the tolerances its arithmetic allows."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_drafts.core.batch import PackedBatch
from lightning_drafts.registry import REGISTRY
from lightning_drafts.serving.family import DraftFamily
from lightning_drafts.training.module import DraftModule
from tests.support.block_draft_cases import to_padded
from tests.support.builders import VOCAB

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def registered(family: DraftFamily) -> Iterator[DraftFamily]:
    """``family`` in the registry for the block's duration: a shipped one stays, another one is registered
    through the seam every family plugs in through, and unregistered on the way out (error or not)."""
    if family in REGISTRY.families:
        yield family
        return
    REGISTRY.register(family)
    try:
        yield family
    finally:
        REGISTRY.unregister(family)


def no_inputs(module: DraftModule, batch: dict[str, Tensor], seed: int = 0) -> dict[str, Tensor]:
    return {}


def no_padded_inputs(packed: PackedBatch, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
    return {}


def anchor_inputs(module: DraftModule, batch: dict[str, Tensor], seed: int = 0) -> dict[str, Tensor]:
    """The module's own anchor sample (and, under ``variable_prefix``, known-prefix lengths in range)."""
    anchors = module.sample_anchors(batch, generator=torch.Generator().manual_seed(seed))
    inputs = {"anchors": anchors}
    if module.hparams.get("variable_prefix"):
        generator = torch.Generator().manual_seed(seed + 1)
        inputs["prefix_lengths"] = torch.randint(2, module.block_size, anchors.shape, generator=generator)
    return inputs


def padded_anchor_inputs(packed: PackedBatch, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
    """The same anchors (and prefix lengths) in the one-document-per-row layout."""
    anchors, prefix = to_padded(packed, inputs["anchors"], inputs.get("prefix_lengths"))
    return {"anchors": anchors} if prefix is None else {"anchors": anchors, "prefix_lengths": prefix}


@dataclass(frozen=True)
class Tolerance:
    """fp32 round-off a comparison allows: ``rtol`` and ``atol`` plus ``scaled_atol`` times the largest
    magnitude of the reference tensor (gradients of very different sizes share one check)."""

    rtol: float
    atol: float = 0.0
    scaled_atol: float = 0.0

    def assert_close(self, actual: Tensor, expected: Tensor, msg: str = "") -> None:
        scale = max(float(expected.detach().abs().max()), 1e-6) if expected.numel() else 1.0
        torch.testing.assert_close(
            actual,
            expected,
            rtol=self.rtol,
            atol=self.atol + self.scaled_atol * scale,
            msg=(lambda m: f"{msg}: {m}") if msg else None,
        )


@dataclass(frozen=True)
class FamilyCase:
    """How the conformance suite exercises one ``DraftModule`` class.

    Attributes:
        module_class: the class (one of its family's ``DraftFamily.modules``).
        targets: the ``tests.support.builders.TINY_TARGETS`` kinds it supports.
        build: ``(target, **options) -> module``, tiny, every trainable weight moved off its initial value
            (identity / zero-initialised parts must be exercised, and exports must pass validation).
        trained: ``(target kind) -> module`` trained a few optimizer steps on a target with a sharpened LM
            head (greedy choices far from ties), for served decoding.
        num_steps: ``module -> int``, the tokens a served round of its export proposes by default
            (what ``DraftFamily.default_num_steps`` must read back from the export).
        quickstart: its shipped CLI config.
        vocab: documents and prompts draw token ids below it (block drafts reserve their mask token).
        variants: named construction options; packed == padded holds for each.
        loss_inputs / padded_inputs: extra ``compute_loss`` arguments (anchors) for a packed batch, and
            the same ones in the one-document-per-row layout.
        takes_anchors: whether ``compute_loss`` takes anchors (otherwise it must refuse them).
        position_logits: ``(module, batch) -> [B, T, ...]`` draft logits at every row position, where
            the family has them (document isolation is then checked position by position).
        config_of: the draft's serving configuration, which a reload from its export must reproduce.
        details: what ``validate_export(...).details`` must hold for the trained export.
        required_tensor: a tensor every export of it holds (dropping it must stop serving before decoding).
        loss / grads / metrics: packed == padded tolerances.
    """

    module_class: type[DraftModule]
    targets: tuple[str, ...]
    build: Callable[..., DraftModule]
    trained: Callable[[str], DraftModule]
    num_steps: Callable[[DraftModule], int]
    quickstart: Path
    required_tensor: str
    vocab: int = VOCAB
    variants: Mapping[str, Mapping[str, Any]] = field(default_factory=lambda: {"default": {}})
    loss_inputs: Callable[[DraftModule, dict[str, Tensor], int], dict[str, Tensor]] = no_inputs
    padded_inputs: Callable[[PackedBatch, dict[str, Tensor]], dict[str, Tensor]] = no_padded_inputs
    takes_anchors: bool = False
    position_logits: Callable[[DraftModule, dict[str, Tensor]], Tensor] | None = None
    config_of: Callable[[DraftModule], Any] | None = None
    details: Mapping[str, Any] = field(default_factory=dict)
    loss: Tolerance = Tolerance(rtol=1e-6, atol=1e-7)
    grads: Tolerance = Tolerance(rtol=1e-5, scaled_atol=1e-5)
    metrics: Tolerance = Tolerance(rtol=1e-5, atol=1e-6)

    @property
    def name(self) -> str:
        return self.module_class.__name__
