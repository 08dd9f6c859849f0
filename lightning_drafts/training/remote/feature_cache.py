"""FeatureCache: the features a run's target workers send, kept as a features directory for later epochs.

Online, then cached: while the first epoch trains from its target workers, every unit received is cut
into its documents (:func:`~lightning_drafts.datamodules.document_features.cut_documents`) and written at
once to a file of its own under ``DIR/received/`` (memory holds one unit, and a crashed trainer loses
none: a resumed run finds them there). Once every document of the data has arrived (the ones no training
unit held, e.g. validation documents a limited validation run never reached, are asked of the workers
then), the shards are assembled one at a time, in the layout and with the manifest ``lightning-drafts
capture`` writes for the same draft and documents, and the received files are removed. From then on the
run (and any later run of this config) trains from ``DIR`` without the workers.
"""

from __future__ import annotations

import hashlib
import shutil
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open
from torch import Tensor

from lightning_drafts.core.output_lock import exclusive_output
from lightning_drafts.datamodules.document_features import DocumentFeatures, cut_documents, shard_tensors
from lightning_drafts.datamodules.documents import Documents
from lightning_drafts.datamodules.feature_store import read_manifest, write_manifest, write_shard
from lightning_drafts.datamodules.packing import Placement
from lightning_drafts.training.features_manifest import (
    CaptureIdentity,
    check_resumable,
    features_manifest,
    storage_dtype,
)

RECEIVED = "received"
# A document's tensors in a received file: "<source>/<corpus offset>/<part>".
PARTS = ("hidden", "positions", "states")


class FeatureCache:
    """The features directory ``directory`` being filled with the features ``capture`` names, of the
    documents of ``sources`` (the data module's :meth:`captured_sources`; ``data``: its
    :meth:`capture_record`), stored in ``dtype``, about ``shard_bytes`` a shard."""

    def __init__(
        self,
        directory: str | Path,
        capture: CaptureIdentity,
        sources: dict[str, Documents],
        data: dict[str, Any],
        dtype: str,
        shard_bytes: int,
    ) -> None:
        self.directory = Path(directory)
        self.storage = storage_dtype(dtype)
        self.sources = sources
        self.num_layers = len(capture.request.layer_ids)
        self.manifest = features_manifest(capture, self.storage, sources, shard_bytes, data)
        existing = read_manifest(self.directory)
        if existing is not None:
            check_resumable(existing, self.manifest, self.directory)
        self.complete = bool(existing and existing.get("complete"))
        self.received_dir = self.directory / RECEIVED
        # (source, corpus offset) -> the received file holding that document.
        self.index: dict[tuple[str, int], Path] = {}
        # Held until the directory is complete: a second run filling it would interleave its units and
        # assemble shards from another run's half.
        self._writer = ExitStack()
        if not self.complete:
            self._writer.enter_context(exclusive_output(self.directory))
            self.directory.mkdir(parents=True, exist_ok=True)
            if existing is None:
                write_manifest(self.directory, {**self.manifest, "complete": False, "capture_seconds": 0.0})
            self.received_dir.mkdir(exist_ok=True)
            for path in sorted(self.received_dir.glob("*.safetensors")):
                self._note(path)

    def _note(self, path: Path) -> None:
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                source, start, part = key.split("/")
                if part == PARTS[0]:
                    self.index[(source, int(start))] = path

    def receive(
        self, source: str, documents: Documents, placement: Placement, features: dict[str, Tensor]
    ) -> None:
        """Keep the features of the micro-batch ``placement`` lays out of ``documents`` (of ``source``)."""
        if self.complete:
            return
        tensors = {}
        for start, doc in cut_documents(documents, placement, features, self.storage).items():
            for part in PARTS:
                tensors[f"{source}/{start}/{part}"] = getattr(doc, part)
        # Named by the documents it holds: a unit received again (after a resume) rewrites its own file.
        name = hashlib.sha256(" ".join(sorted(tensors)).encode()).hexdigest()[:24]
        path = self.received_dir / f"{name}.safetensors"
        write_shard(path, tensors)
        self._note(path)

    def missing(self) -> dict[str, Documents]:
        """The documents of each source not received yet."""
        out = {}
        for source, documents in self.sources.items():
            absent = [
                i for i, start in enumerate(documents.starts.tolist()) if (source, start) not in self.index
            ]
            if absent:
                out[source] = documents.select(np.asarray(absent))
        return out

    def finish(self) -> None:
        """Write the shards (every document must have been received), mark the directory complete and
        remove the received files."""
        if self.complete:
            return
        missing = {source: len(documents) for source, documents in self.missing().items()}
        if missing:
            raise ValueError(
                f"the features cache {self.directory} lacks {missing} documents; they must be received first"
            )
        for source, entry in self.manifest["sources"].items():
            for shard in entry["shards"]:
                begin, end = shard["documents"]
                documents = self.sources[source].select(np.arange(begin, end))
                write_shard(self.directory / shard["file"], self._shard(source, documents))
        write_manifest(self.directory, {**self.manifest, "complete": True, "capture_seconds": 0.0})
        shutil.rmtree(self.received_dir, ignore_errors=True)
        self.complete = True
        self._writer.close()

    def _shard(self, source: str, documents: Documents) -> dict[str, Tensor]:
        features, handles = {}, {}
        for start in documents.starts.tolist():
            path = self.index[(source, start)]
            if path not in handles:
                handles[path] = safe_open(str(path), framework="pt")
            parts = {part: handles[path].get_tensor(f"{source}/{start}/{part}") for part in PARTS}
            features[start] = DocumentFeatures(**parts)
        return shard_tensors(documents, features, self.storage, self.num_layers)
