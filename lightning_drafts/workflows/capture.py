"""Capture a draft's target features once, so it can train for many epochs without the target's forward.

``capture_features(module, datamodule, output_dir)`` runs the module's frozen target over every document
of the data module's sources (packed rows, documents isolated, the target's fastest attention path) and
writes exactly what the module's :meth:`~lightning_drafts.training.module.DraftModule.feature_request`
names into a features directory (:mod:`lightning_drafts.datamodules.feature_store`). It estimates the
disk it needs first and refuses with the figure when the free space is short; it resumes a stopped capture
at its first missing shard (the manifest must be the same, field by field); under ``torch.distributed``
each rank captures every ``world_size``-th shard and rank 0 completes the manifest.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from lightning_drafts.core.output_lock import OutputInUse, exclusive_output
from lightning_drafts.core.target_features import FeatureRequest
from lightning_drafts.datamodules import PackedChatDataModule
from lightning_drafts.datamodules.document_features import cut_documents, shard_tensors, teacher_dtype
from lightning_drafts.datamodules.documents import Documents
from lightning_drafts.datamodules.feature_store import (
    FLOAT8,
    read_manifest,
    shard_name,
    write_manifest,
    write_shard,
)
from lightning_drafts.datamodules.packing import collate_placed, place, plan_epoch
from lightning_drafts.serving.progress import announce
from lightning_drafts.training.features_manifest import (
    SHARD_BYTES,
    check_resumable,
    features_manifest,
    storage_dtype,
)
from lightning_drafts.training.module import DraftModule


@dataclass(frozen=True)
class CaptureSummary:
    """What a capture call did: shards written now and present in all, bytes on disk, seconds taken."""

    directory: Path
    shards_written: int
    shards_total: int
    bytes_estimated: int
    complete: bool
    seconds: float


def capture_features(
    module: DraftModule,
    datamodule: PackedChatDataModule,
    output_dir: str | Path,
    dtype: str = "bfloat16",
    rows_per_batch: int | None = None,
    **options: Any,
) -> CaptureSummary:
    """Capture ``module``'s target features for every document of ``datamodule`` into ``output_dir``
    (the data module's tokenizer, chat template and data settings go into the manifest).

    ``rows_per_batch``: documents per forward (default the data module's ``batch_size``); ``options``:
    those of :func:`capture_documents`.
    """
    datamodule.setup("fit")
    return capture_documents(
        module,
        datamodule.captured_sources(),
        output_dir,
        max_tokens=datamodule.max_tokens,
        pad_token_id=datamodule.pad_token_id,
        data=datamodule.capture_record(),
        dtype=dtype,
        rows_per_batch=rows_per_batch or datamodule.batch_size,
        **options,
    )


def capture_documents(
    module: DraftModule,
    sources: dict[str, Documents],
    output_dir: str | Path,
    *,
    max_tokens: int,
    pad_token_id: int,
    data: dict[str, Any],
    dtype: str = "bfloat16",
    rows_per_batch: int = 8,
    shard_bytes: int = SHARD_BYTES,
    keep_free_bytes: int = 0,
    max_shards: int | None = None,
    device: str | torch.device | None = None,
) -> CaptureSummary:
    """Capture ``module``'s target features for the documents of each source into ``output_dir``.

    Args:
        sources: documents per source name (``data_files`` / ``val_data_files``), each one tokenised corpus.
        max_tokens, pad_token_id: the rows the documents are packed into for the target's forward.
        data: what the documents were made with (recorded in the manifest, checked by the data module).
        dtype: storage dtype of the features (``"bfloat16"`` halves ``"float32"``; exact parity with
            the online step needs ``"float32"``; ``"float8_e4m3fn"`` halves bfloat16 again for the captured
            layers, with a scale per token and layer, the teacher's final state kept in bfloat16).
        rows_per_batch: documents per forward.
        shard_bytes: about how many bytes of features each shard holds.
        keep_free_bytes: refuse unless this much disk stays free after the capture.
        max_shards: stop after writing this many shards (the capture stays incomplete and resumes on the
            next call), e.g. to spread one capture over several jobs.
        device: where the target runs (default: CUDA when available, else CPU).
    """
    started = time.perf_counter()
    directory = Path(output_dir)
    with _one_capture(directory):
        storage = storage_dtype(dtype)
        request = module.feature_request()
        manifest = features_manifest(module.capture_identity(), storage, sources, shard_bytes, data)
        estimate = _estimate_bytes(manifest, storage)
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)

        directory.mkdir(parents=True, exist_ok=True)
        existing = read_manifest(directory)
        if existing is not None:
            check_resumable(existing, manifest, directory)
            manifest = {**manifest, "capture_seconds": existing.get("capture_seconds", 0.0)}
        if dist.is_initialized():
            dist.barrier()  # every rank has read the manifest before rank 0 writes one
        if existing is None and rank == 0:
            write_manifest(directory, {**manifest, "complete": False, "capture_seconds": 0.0})
        todo = [
            (source, index, shard["documents"])
            for source, entry in manifest["sources"].items()
            for index, shard in enumerate(entry["shards"])
            if not (directory / shard["file"]).exists()
        ]
        _check_disk(directory, estimate, todo, manifest, keep_free_bytes)
        if existing is not None and rank == 0:
            total = sum(len(entry["shards"]) for entry in manifest["sources"].values())
            announce(
                f"resuming the capture in {directory}: {total - len(todo)} of {total} shards are there, "
                f"{len(todo)} to write"
            )

        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        module.target.to(device)
        written = 0
        for position, (source, index, (begin, end)) in enumerate(todo):
            if position % world != rank:
                continue
            if max_shards is not None and written >= max_shards:
                break
            shard = sources[source].select(np.arange(begin, end))
            tensors = _capture_shard(
                module, shard, request, storage, rows_per_batch, max_tokens, pad_token_id, device
            )
            write_shard(directory / shard_name(source, index), tensors)
            written += 1
        if dist.is_initialized():
            dist.barrier()
        shards = [shard["file"] for entry in manifest["sources"].values() for shard in entry["shards"]]
        total, present = len(shards), sum((directory / name).exists() for name in shards)
        seconds = time.perf_counter() - started
        if rank == 0:
            elapsed = float(manifest.get("capture_seconds", 0.0)) + seconds
            write_manifest(directory, {**manifest, "complete": present == total, "capture_seconds": elapsed})
        if dist.is_initialized():
            dist.barrier()
        return CaptureSummary(directory, written, total, estimate, present == total, seconds)


@contextmanager
def _one_capture(directory: Path) -> Iterator[None]:
    """One capture per directory: rank 0 holds its lock for the job's ranks, and every rank learns at once
    whether it got it (a rank raising alone would leave the others waiting at a barrier)."""
    with ExitStack() as stack:
        refused = ""
        if not dist.is_initialized() or dist.get_rank() == 0:
            try:
                stack.enter_context(exclusive_output(directory))
            except OutputInUse as error:
                refused = str(error)
        if dist.is_initialized():
            shared = [refused]
            dist.broadcast_object_list(shared, src=0)
            refused = shared[0]
        if refused:
            raise OutputInUse(refused)
        yield


def _estimate_bytes(manifest: dict[str, Any], storage: torch.dtype) -> int:
    """tokens x layers x hidden x bytes, plus the final-state rows (and their int32 positions)."""
    hidden, layers = manifest["target"]["hidden_size"], len(manifest["layer_ids"])
    scales = layers * 4 if storage == FLOAT8 else 0
    total = 0
    for entry in manifest["sources"].values():
        total += entry["tokens"] * (layers * hidden * storage.itemsize + scales)
        total += entry["final_rows"] * (hidden * teacher_dtype(storage).itemsize + 4)
    return total


def _check_disk(
    directory: Path, estimate: int, todo: list, manifest: dict[str, Any], keep_free_bytes: int
) -> None:
    entries = manifest["sources"]
    remaining = sum(end - begin for _, _, (begin, end) in todo)
    all_documents = sum(entry["documents"] for entry in entries.values()) or 1
    # The shards still to write, pro rata by document count.
    needed = estimate * remaining // all_documents
    free = shutil.disk_usage(directory).free
    if free - needed < keep_free_bytes:
        raise ValueError(
            f"the capture needs about {_gib(needed)} more on {directory} ({_gib(estimate)} in all: tokens x layers "
            f"x hidden x bytes, plus the teacher rows) and keep_free_bytes={_gib(keep_free_bytes)} must stay free, "
            f"but only {_gib(free)} is free; free some space, pick another output directory or a smaller dtype"
        )


def _gib(count: int) -> str:
    return f"{count / 2**30:.3f} GiB ({count:,} bytes)"


@torch.no_grad()
def _capture_shard(
    module: DraftModule,
    documents: Documents,
    request: FeatureRequest,
    storage: torch.dtype,
    rows_per_batch: int,
    max_tokens: int,
    pad_token_id: int,
    device: torch.device,
) -> dict[str, Tensor]:
    """One shard's tensors: its documents packed into rows (in order, ``rows_per_batch`` documents per
    forward), each document's features cut back out of the rows."""
    plan = plan_epoch(
        documents.lengths,
        mode="microbatch",
        max_tokens=max_tokens,
        batch_size=rows_per_batch,
        seed=0,
        epoch=0,
        shuffle=False,
    )
    received = {}
    for index in range(len(plan)):
        placement = place(documents, plan, index)
        batch = collate_placed(documents, placement, pad_token_id)
        features = module.features_for({k: v.to(device) for k, v in batch.items()})
        received.update(cut_documents(documents, placement, features, storage))
    return shard_tensors(documents, received, storage, len(request.layer_ids))
