"""A features directory: a frozen target's captured signal per document, in memory-mappable shards.

Layout of ``DIR``:

* ``features.json``, the manifest: format and version, whether the capture is ``complete``, the target's
  identity, the layers and final-state positions captured, the storage dtype, the tokenizer / chat
  template / data digests, and per source (``data_files``, ``val_data_files``) its counts and shards;
* ``<source>-<index>.safetensors``, each holding a contiguous run of that source's documents (ordered by
  their offset in the tokenised corpus): ``hidden_states`` ``[tokens, k * H]`` (every token's captured
  layers; in float8 with ``hidden_scales`` ``[tokens, k]``, see :func:`quantize_rows`), ``last_hidden_state`` ``[rows, H]`` with ``last_hidden_positions`` (int32, in-document) where
  the final-norm state was kept, and the per-document table ``doc_starts`` / ``doc_lengths`` /
  ``doc_final_rows``.

Why safetensors: a shard is one file per tensor group whose slices are read straight from the page
cache (``safe_open(...).get_slice``), bfloat16 included, with no decoding step; Arrow (``datasets``) has
no bfloat16 and goes through a row-by-row conversion (see benchmarks/feature_storage.py for the figures).
A shard is written to a temporary name and renamed, so a shard that exists is whole: a killed capture
resumes at the first missing shard. This module knows no draft family: the keys it serves are those of
:mod:`lightning_drafts.core.target_features`, and drafts check the manifest themselves.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from lightning_drafts.datamodules.documents import Documents
from lightning_drafts.datamodules.packing import Placement

FORMAT = "lightning-drafts-features"
# float8 storage keeps one scale per token and captured layer: the largest magnitude maps to the format's
# largest finite value, so a layer's outliers (massive activations) never overflow.
FLOAT8 = torch.float8_e4m3fn
FLOAT8_MAX = float(torch.finfo(FLOAT8).max)
VERSION = 1
MANIFEST = "features.json"
SOURCES = ("data_files", "val_data_files")


def shard_name(source: str, index: int) -> str:
    return f"{source}-{index:05d}.safetensors"


def union_by_start(parts: Sequence[Documents | None]) -> Documents | None:
    """The documents of ``parts`` (splits of one tokenised corpus) once each, ordered by corpus offset:
    the same set whatever the split seed or fraction."""
    present = [part for part in parts if part is not None and len(part)]
    if not present:
        return None
    starts = np.concatenate([part.starts for part in present])
    lengths = np.concatenate([part.lengths for part in present])
    order = np.unique(starts, return_index=True)[1]
    base = present[0]
    return Documents(base.input_ids, base.loss_mask, starts[order], lengths[order])


def documents_digest(documents: Documents) -> str:
    """A digest of the documents' offsets, lengths, tokens and loss masks (what the features belong to)."""
    digest = hashlib.sha256()
    for values in (documents.starts, documents.lengths):
        digest.update(np.ascontiguousarray(values, dtype=np.int64).tobytes())
    ends = np.cumsum(documents.lengths)
    flat = np.arange(int(ends[-1]) if len(documents) else 0) - np.repeat(
        ends - documents.lengths, documents.lengths
    )
    flat = flat + np.repeat(documents.starts, documents.lengths)
    digest.update(np.ascontiguousarray(documents.input_ids[flat], dtype=np.int64).tobytes())
    digest.update(np.ascontiguousarray(documents.loss_mask[flat], dtype=np.int8).tobytes())
    return digest.hexdigest()[:32]


def final_rows_per_document(documents: Documents, rule: str) -> np.ndarray:
    """How many final-state rows each document stores under ``rule`` (``FINAL_POSITIONS``)."""
    if rule == "none":
        return np.zeros(len(documents), dtype=np.int64)
    if rule == "all":
        return documents.lengths.astype(np.int64)
    if rule == "supervised":
        return documents.supervised_per_document()
    if rule == "next_supervised":
        # Supervised tokens after each document's first: each is the "next" of the token before it.
        first = documents.loss_mask[documents.starts].astype(np.int64) * (documents.lengths > 0)
        return documents.supervised_per_document() - first
    raise ValueError(f"final_positions {rule!r} is not a known rule")


def shard_bounds(lengths: np.ndarray, tokens_per_shard: int) -> list[tuple[int, int]]:
    """Contiguous document ranges of about ``tokens_per_shard`` tokens each (at least one document)."""
    bounds, begin, tokens = [], 0, 0
    for index, length in enumerate(lengths.tolist()):
        tokens += length
        if tokens >= tokens_per_shard:
            bounds.append((begin, index + 1))
            begin, tokens = index + 1, 0
    if begin < len(lengths):
        bounds.append((begin, len(lengths)))
    return bounds


def quantize_rows(rows: Tensor, layers: int) -> tuple[Tensor, Tensor]:
    """``[n, layers * H]`` -> float8 values of the same shape and float32 scales ``[n, layers]``."""
    chunks = rows.float().reshape(rows.shape[0], max(layers, 1), -1)
    scales = chunks.abs().amax(dim=-1).clamp(min=torch.finfo(torch.float32).tiny) / FLOAT8_MAX
    values = (chunks / scales[..., None]).to(FLOAT8)
    return values.reshape(rows.shape), scales


def dequantize_rows(values: Tensor, scales: Tensor) -> Tensor:
    """The inverse of :func:`quantize_rows`, in bfloat16."""
    chunks = values.float().reshape(values.shape[0], scales.shape[1], -1) * scales[..., None]
    return chunks.reshape(values.shape).to(torch.bfloat16)


def write_shard(path: Path, tensors: dict[str, Tensor]) -> None:
    """Write a shard whole or not at all: a partial file never carries the shard's name."""
    partial = path.with_name(path.name + ".partial")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(partial))
    # Readable by others like the manifest (safetensors creates its file 0600), so another user's job
    # can train from a shared capture.
    os.chmod(partial, 0o644)
    os.replace(partial, path)


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    partial = directory / (MANIFEST + ".partial")
    partial.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    os.replace(partial, directory / MANIFEST)


def read_manifest(directory: str | Path) -> dict[str, Any] | None:
    path = Path(directory) / MANIFEST
    if not path.exists():
        return None
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise ValueError(
            f"{path} is not a version-{VERSION} {FORMAT} manifest (format {manifest.get('format')!r}, version "
            f"{manifest.get('version')!r}); capture again with this version"
        )
    return manifest


class FeatureStore:
    """A complete features directory, read lazily: shards are memory-mapped on first use."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        manifest = read_manifest(self.directory)
        if manifest is None:
            raise ValueError(
                f"features_dir {str(self.directory)!r} has no {MANIFEST}; run `lightning-drafts capture` first"
            )
        if not manifest.get("complete"):
            raise ValueError(
                f"the capture in {self.directory} is incomplete (it was stopped before its last shard); run the "
                "same `lightning-drafts capture` again: it resumes where it stopped"
            )
        self.manifest = {**manifest, "directory": str(self.directory)}
        self._sources: dict[str, SourceFeatures] = {}

    def check_data(self, identity: dict[str, Any], sources: dict[str, Documents | None]) -> None:
        """Refuse features made from other data: ``identity`` (tokenizer, chat template digests) and each
        source's documents must be those captured; the first differing field is named."""
        for field, value in identity.items():
            if self.manifest.get(field) != value:
                raise ValueError(
                    f"{self.directory} was captured with another {field}: {self.manifest.get(field)!r} there, "
                    f"{value!r} here; use the data settings it was captured with or capture again"
                )
        recorded = self.manifest.get("sources", {})
        for source, documents in sources.items():
            captured = recorded.get(source)
            if documents is None:
                continue
            if captured is None:
                raise ValueError(
                    f"{self.directory} holds no features for {source} (it was captured without them); run "
                    f"`lightning-drafts capture` again with this {source} into a new directory"
                )
            digest = documents_digest(documents)
            if captured["documents_digest"] != digest:
                raise ValueError(
                    f"{self.directory} was captured from other documents for {source} ({captured['documents']} "
                    f"documents, {captured['tokens']} tokens there; {len(documents)} documents, "
                    f"{documents.num_tokens} tokens here): the data files, max_tokens, long_documents or "
                    "max_documents differ; use the capture's settings or capture again"
                )

    def source(self, name: str) -> SourceFeatures:
        if name not in self._sources:
            entry = self.manifest.get("sources", {}).get(name)
            if entry is None:
                raise ValueError(f"{self.directory} holds no features for {name}")
            self._sources[name] = SourceFeatures(self.directory, entry, self.manifest)
        return self._sources[name]


class SourceFeatures:
    """One source's documents' features: look documents up by corpus offset and lay them out as a batch."""

    def __init__(self, directory: Path, entry: dict[str, Any], manifest: dict[str, Any]) -> None:
        self.paths = [directory / shard["file"] for shard in entry["shards"]]
        self.layer_ids = tuple(manifest["layer_ids"])
        self.hidden_size = int(manifest["target"]["hidden_size"])
        self.stores_final = manifest["final_positions"] != "none"
        self.scaled = manifest["dtype"] == str(FLOAT8).removeprefix("torch.")
        self._handles: dict[int, Any] = {}
        tables = []
        for index in range(len(self.paths)):
            handle = self._handle(index)
            starts, lengths, finals = (
                handle.get_tensor(k).numpy() for k in ("doc_starts", "doc_lengths", "doc_final_rows")
            )
            tables.append((np.full(len(starts), index), starts, lengths, finals))
        shard, starts, lengths, finals = (np.concatenate(column) for column in zip(*tables, strict=True))
        self.doc_shard, self.doc_starts, self.doc_lengths = shard, starts, lengths
        # Offsets inside each document's own shard.
        self.doc_token_offset = _offsets_within(shard, lengths)
        self.doc_final_offset = _offsets_within(shard, finals)
        self.doc_final_rows = finals

    def __getstate__(self) -> dict[str, Any]:
        # Memory maps stay in the process that opened them; a DataLoader worker opens its own.
        return {**self.__dict__, "_handles": {}}

    def _handle(self, index: int) -> Any:
        if index not in self._handles:
            path = self.paths[index]
            try:
                self._handles[index] = safe_open(str(path), framework="pt")
            except (SafetensorError, OSError) as error:
                # A shard is renamed into place whole, so a damaged one was cut short or changed since
                # (a copy that stopped, a full disk): the capture rewrites a shard that is not there.
                state = f"{path.stat().st_size:,} bytes, unreadable" if path.exists() else "missing"
                raise ValueError(
                    f"feature shard {path} is {state} ({str(error).splitlines()[0]}); delete it and run the "
                    "same `lightning-drafts capture` again: it rewrites the shards that are not there"
                ) from error
        return self._handles[index]

    def gather(self, documents: Documents, placement: Placement) -> dict[str, Tensor]:
        """The feature keys of the micro-batch ``placement`` lays out (``[R, W, ...]``, zero on padding)."""
        found = np.searchsorted(self.doc_starts, documents.starts[placement.docs])
        found = np.minimum(found, len(self.doc_starts) - 1)
        wanted = documents.starts[placement.docs]
        if not np.array_equal(self.doc_starts[found], wanted) or not np.array_equal(
            self.doc_lengths[found], placement.lengths
        ):
            raise ValueError(
                "a document of this batch has no captured features of its length; the features directory was "
                "captured from other documents (the data module checks this at setup: call setup first)"
            )
        pieces, final_pieces, final_slots = [], [], []
        for j, doc in enumerate(found.tolist()):
            handle = self._handle(int(self.doc_shard[doc]))
            start = int(self.doc_token_offset[doc])
            stop = start + int(self.doc_lengths[doc])
            piece = handle.get_slice("hidden_states")[start:stop]
            if self.scaled:
                piece = dequantize_rows(piece, handle.get_slice("hidden_scales")[start:stop])
            pieces.append(piece)
            if self.stores_final and self.doc_final_rows[doc]:
                begin = int(self.doc_final_offset[doc])
                end = begin + int(self.doc_final_rows[doc])
                final_pieces.append(handle.get_slice("last_hidden_state")[begin:end])
                positions = handle.get_slice("last_hidden_positions")[begin:end].long()
                final_slots.append(positions + int(placement.doc_base[j]))
        slots = placement.num_rows * placement.width
        shape = (placement.num_rows, placement.width)
        hidden = torch.cat(pieces)
        flat = hidden.new_zeros(slots, hidden.shape[-1])
        flat[torch.from_numpy(placement.target)] = hidden
        out = {
            "target_layer_ids": torch.tensor(self.layer_ids, dtype=torch.long),
            "target_hidden_states": flat.reshape(*shape, -1),
        }
        if self.stores_final:
            last = hidden.new_zeros(slots, self.hidden_size)
            mask = torch.zeros(slots, dtype=torch.bool)
            if final_pieces:
                where = torch.cat(final_slots)
                last[where] = torch.cat(final_pieces)
                mask[where] = True
            out["target_last_hidden_state"] = last.reshape(*shape, -1)
            out["target_last_hidden_mask"] = mask.reshape(shape)
        return out


def _offsets_within(shard: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Each entry's offset inside its own shard (entries of a shard are contiguous and in order)."""
    ends = np.cumsum(sizes)
    begins = ends - sizes
    first_of_shard = np.searchsorted(shard, shard, side="left")
    return begins - begins[first_of_shard]
