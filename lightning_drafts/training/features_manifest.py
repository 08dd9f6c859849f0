"""The manifest of a features directory written for a draft: what its features were made from.

``lightning-drafts capture`` and a run that caches what its target workers send (``remote.cache_dir``)
write one manifest for the same draft, target and documents, field for field, so a directory is the same
whichever wrote it, and either resumes the other's partial one only if it records the same capture.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lightning_drafts.core.target_features import FeatureRequest
from lightning_drafts.datamodules.documents import Documents
from lightning_drafts.datamodules.feature_store import (
    FLOAT8,
    FORMAT,
    MANIFEST,
    VERSION,
    documents_digest,
    final_rows_per_document,
    shard_bounds,
    shard_name,
)
from lightning_drafts.training.target import as_dtype

# About this many bytes of features per shard: large enough that a shard costs one open, small enough
# that a stopped capture loses little (a cache uses the same, so both write one directory for one data).
SHARD_BYTES = 1 << 30
# float8 stores the captured layers with a scale per token and layer (the final state stays bfloat16).
STORAGE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, FLOAT8)
# Fields of the manifest that describe the progress, not what was captured (a resume may differ in them).
PROGRESS_FIELDS = ("complete", "capture_seconds")


def storage_dtype(dtype: str) -> torch.dtype:
    """The torch dtype of a storage dtype name; refuses one a features directory cannot hold."""
    resolved = as_dtype(dtype)
    if resolved not in STORAGE_DTYPES:
        names = [str(d).removeprefix("torch.") for d in STORAGE_DTYPES]
        raise ValueError(f"dtype {dtype!r} cannot store features; use one of {names} (default 'bfloat16')")
    return resolved


@dataclass(frozen=True)
class CaptureIdentity:
    """What a features directory is captured for: the draft's feature ``request``, the target's identity
    (:meth:`FrozenTarget.identity`), the target as the config names it (``None`` for a model instance)
    and the draft's ``module.Class`` (``DraftModule.capture_identity`` builds it)."""

    request: FeatureRequest
    target_identity: dict[str, Any]
    target_spec: str | dict[str, Any] | None
    draft_class: str


def features_manifest(
    capture: CaptureIdentity,
    storage: torch.dtype,
    sources: dict[str, Documents],
    shard_bytes: int,
    data: dict[str, Any],
) -> dict[str, Any]:
    """The manifest (without its progress fields) of the features ``capture`` names of ``sources`` stored
    in ``storage``, ``shard_bytes`` a shard; ``data`` is what the documents were made with."""
    request, identity = capture.request, capture.target_identity
    hidden = identity["hidden_size"]
    bytes_per_token = len(request.layer_ids) * hidden * storage.itemsize
    tokens_per_shard = max(1, shard_bytes // max(bytes_per_token, 1))
    entries = {}
    for name, documents in sources.items():
        finals = final_rows_per_document(documents, request.final_positions)
        entries[name] = {
            "documents": len(documents),
            "tokens": documents.num_tokens,
            "final_rows": int(finals.sum()),
            "documents_digest": documents_digest(documents),
            "shards": [
                {"file": shard_name(name, i), "documents": [begin, end]}
                for i, (begin, end) in enumerate(shard_bounds(documents.lengths, tokens_per_shard))
            ],
        }
    return {
        "format": FORMAT,
        "version": VERSION,
        "target": {**identity, "spec": capture.target_spec},
        "draft_class": capture.draft_class,
        "layer_ids": list(request.layer_ids),
        "final_positions": request.final_positions,
        "dtype": str(storage).removeprefix("torch."),
        **data,
        "sources": entries,
    }


def check_resumable(existing: dict[str, Any], manifest: dict[str, Any], directory: Path) -> None:
    """Refuse to continue the partial directory whose manifest is ``existing`` as ``manifest``'s, naming
    the first field that differs."""
    for field in sorted(set(existing) | set(manifest)):
        if field in PROGRESS_FIELDS:
            continue
        if existing.get(field) != manifest.get(field):
            raise ValueError(
                f"{directory / MANIFEST} records another capture: its {field!r} is {existing.get(field)!r}, this "
                f"one's {manifest.get(field)!r}; capture into an empty directory (or delete that one)"
            )
