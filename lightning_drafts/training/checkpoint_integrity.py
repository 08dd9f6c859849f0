"""Whole-checkpoint integrity and family checks, written once for every reader of a checkpoint.

A checkpoint records a digest of each of its sections when it is written (the draft's weights, the
optimizer state, the learning-rate schedule, the loops' progress, the callbacks' and the data loader's
state, the hyperparameters, ...). Every command that reads one (fit resume, validate, export, load)
recomputes them and refuses a checkpoint whose bytes changed since, naming what changed: a disk error in
the AdamW moments would otherwise resume "successfully" and train on wrong numbers. A checkpoint of
another draft family than the run's is refused naming both.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from torch import Tensor
from torch.distributed.tensor import DTensor

from lightning_drafts.core.digest import state_digest, value_digest

DIGEST_KEY = "checkpoint_digest"
# Written, and digested, with the digests: a checkpoint that has it but no digests had them removed. A
# sharded checkpoint records SHARDED there instead: torch.distributed checks its shards.
DIGESTED_KEY = "checkpoint_digested"
SHARDED = "sharded"
# What releases before the whole-checkpoint digest recorded: the draft tensors only.
DRAFT_DIGEST_KEY = "draft_digest"
# Lightning's names of the sections, and what each holds, for the message that names a damaged one.
SECTIONS = {
    "state_dict": "the draft's weights",
    "optimizer_states": "the optimizer state: AdamW moments and step counts",
    "lr_schedulers": "the learning-rate schedule",
    "loops": "the training loop's progress: steps, epochs, batches",
    "callbacks": "the callbacks' state: checkpoint bookkeeping, metrics",
    "hyper_parameters": "the model's hyperparameters",
    "datamodule_hyper_parameters": "the data module's hyperparameters",
    "epoch": "the epoch counter",
    "global_step": "the step counter",
    "PackedChatDataModule": "the train loader's position",
    "draft_class": "the draft family",
    DIGESTED_KEY: "the mark that the checkpoint was written with digests",
}


def record_digests(checkpoint: dict[str, Any]) -> None:
    """Write the digest of every section of ``checkpoint`` into it (call last, once it is complete).
    A sharded checkpoint (DTensors) is left to torch.distributed's own checks."""
    if _holds_dtensors(checkpoint.get("state_dict", {})):
        checkpoint[DIGESTED_KEY] = SHARDED
        return
    checkpoint[DIGESTED_KEY] = True
    checkpoint[DIGEST_KEY] = {
        name: value_digest(value)
        for name, value in checkpoint.items()
        if name not in (DIGEST_KEY, DRAFT_DIGEST_KEY)
    }


def check_digests(
    checkpoint: Mapping[str, Any], where: str = "the checkpoint", skip: Iterable[str] = ()
) -> None:
    """Refuse ``checkpoint`` if any recorded section (but ``skip``: sections its reader changed on purpose)
    no longer matches its digest, naming each damaged one."""
    recorded, digested = checkpoint.get(DIGEST_KEY), checkpoint.get(DIGESTED_KEY)
    if recorded is None and digested == SHARDED:
        return
    if recorded is None and digested:
        raise ValueError(
            f"{where} was written with digests of its sections but holds none (its {DIGEST_KEY!r} entry was "
            "removed: an edit, or a rewrite by another tool), so nothing in it can be verified; use another "
            "checkpoint (e.g. an earlier last.ckpt or best.ckpt)"
        )
    if recorded is None:
        if DRAFT_DIGEST_KEY not in checkpoint:
            warnings.warn(
                f"{where} records no digests (written by a lightning-drafts release older than them, or by "
                "another tool): its sections are read unverified",
                stacklevel=2,
            )
        _check_draft_digest(checkpoint, where)
        return
    damaged = [
        name
        for name, digest in recorded.items()
        if name not in skip and (name not in checkpoint or value_digest(checkpoint[name]) != digest)
    ]
    if damaged:
        what = "; ".join(f"{name} ({SECTIONS.get(name, 'a section of the checkpoint')})" for name in damaged)
        raise ValueError(
            f"{where} is damaged: {what} no longer match{'es' if len(damaged) == 1 else ''} the digest written "
            "with it (a truncated copy, a disk error, or an edit); use another checkpoint (e.g. an earlier "
            "last.ckpt or best.ckpt)"
        )


def _check_draft_digest(checkpoint: Mapping[str, Any], where: str) -> None:
    recorded = checkpoint.get(DRAFT_DIGEST_KEY)
    if recorded is not None and (
        "state_dict" not in checkpoint or state_digest(checkpoint["state_dict"]) != recorded
    ):
        raise ValueError(
            f"{where} is damaged: state_dict ({SECTIONS['state_dict']}) no longer matches the digest written "
            "with it (a truncated copy, a disk error, or an edit); use another checkpoint (e.g. an earlier "
            "last.ckpt or best.ckpt)"
        )


def check_family(
    checkpoint: Mapping[str, Any], expected: str, where: str = "the checkpoint", former: Iterable[str] = ()
) -> None:
    """Refuse a checkpoint whose ``draft_class`` is not ``expected`` (``module.Class``) nor one of the
    ``former`` paths that class was defined at, naming both."""
    recorded = checkpoint.get("draft_class")
    if recorded is None or recorded == expected or recorded in tuple(former):
        return
    raise ValueError(
        f"{where} holds a {recorded.rsplit('.', 1)[-1]} draft ({recorded}) but this run's model is "
        f"{expected.rsplit('.', 1)[-1]} ({expected}); use a checkpoint of this family, or the config it was "
        "trained with"
    )


def _holds_dtensors(state: Mapping[str, Any]) -> bool:
    return any(isinstance(value, DTensor) for value in state.values() if isinstance(value, Tensor))
