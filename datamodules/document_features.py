"""A micro-batch's target features cut back into its documents, and a shard's tensors made from them.

The inverse of :meth:`~lightning_drafts.datamodules.feature_store.SourceFeatures.gather`: a capture (and a
run that caches what its target workers send) receives features laid out as packed rows, and a features
directory stores them per document. Cutting is by the batch's :class:`Placement`, so a document's features
are the same whichever rows it was packed into, and a shard is the same whatever order its documents
arrived in.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from lightning_drafts.datamodules.documents import Documents
from lightning_drafts.datamodules.feature_store import FLOAT8, quantize_rows
from lightning_drafts.datamodules.packing import Placement


@dataclass(frozen=True)
class DocumentFeatures:
    """One document's features as a shard stores them: every token's captured layers ``hidden``
    ``[length, k * H]`` (in the storage dtype; the compute dtype for float8, which quantizes per shard),
    and where the final-norm state was kept, its in-document ``positions`` (int32) and ``states``."""

    hidden: Tensor
    positions: Tensor
    states: Tensor


def teacher_dtype(storage: torch.dtype) -> torch.dtype:
    """float8 is for the captured layers only: the teacher's final state keeps bfloat16."""
    return torch.bfloat16 if storage == FLOAT8 else storage


def cut_documents(
    documents: Documents, placement: Placement, features: dict[str, Tensor], storage: torch.dtype
) -> dict[int, DocumentFeatures]:
    """The features of each document of the micro-batch ``placement`` laid out, keyed by the document's
    corpus offset (``documents.starts``), on the CPU."""
    device = features["target_hidden_states"].device
    flat = features["target_hidden_states"].flatten(0, 1)[torch.from_numpy(placement.target).to(device)]
    pieces = (flat.to(storage) if storage != FLOAT8 else flat).cpu().split(placement.lengths.tolist())
    stores_final = "target_last_hidden_state" in features
    if stores_final:
        states = features["target_last_hidden_state"].flatten(0, 1)
        mask = features["target_last_hidden_mask"].flatten()
    hidden_size = int(features["target_hidden_states"].shape[-1]) // max(
        int(features["target_layer_ids"].numel()), 1
    )
    teacher = teacher_dtype(storage)
    out = {}
    for j, doc in enumerate(placement.docs.tolist()):
        if stores_final:
            base, length = int(placement.doc_base[j]), int(placement.lengths[j])
            kept = mask[base : base + length].nonzero().squeeze(1)
            positions, kept_states = kept.to(torch.int32).cpu(), states[base + kept].to(teacher).cpu()
        else:
            positions = torch.zeros(0, dtype=torch.int32)
            kept_states = torch.zeros(0, hidden_size, dtype=teacher)
        out[int(documents.starts[doc])] = DocumentFeatures(pieces[j], positions, kept_states)
    return out


def shard_tensors(
    documents: Documents,
    features: dict[int, DocumentFeatures],
    storage: torch.dtype,
    num_layers: int,
) -> dict[str, Tensor]:
    """The tensors of the shard holding ``documents`` (in their order), from ``features`` keyed by corpus
    offset (see the layout in :mod:`lightning_drafts.datamodules.feature_store`)."""
    order = [features[int(start)] for start in documents.starts.tolist()]
    hidden = torch.cat([doc.hidden for doc in order])
    scaled = {}
    if storage == FLOAT8:
        hidden, scaled["hidden_scales"] = quantize_rows(hidden, num_layers)
    return {
        **scaled,
        "hidden_states": hidden,
        "last_hidden_state": torch.cat([doc.states for doc in order]),
        "last_hidden_positions": torch.cat([doc.positions for doc in order]),
        "doc_starts": torch.from_numpy(documents.starts.astype(np.int64)),
        "doc_lengths": torch.from_numpy(documents.lengths.astype(np.int64)),
        "doc_final_rows": torch.tensor([len(doc.positions) for doc in order], dtype=torch.int64),
    }
