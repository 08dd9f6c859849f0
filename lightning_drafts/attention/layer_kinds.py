"""What each decoder layer of a transformers target attends to, and that pattern cut per packed document.

A packed row holds several documents, and a layer that does not attend to the whole causal past (a sliding
window, a chunk) must apply its pattern within each document, counted from that document's start, exactly as
the model applies it to the document alone: transformers' masks count from the start of the row, and a
custom mask handed to the model replaces every layer's pattern. A linear-attention layer (a recurrent state
and a causal convolution) carries state along the row, which no attention mask stops, and a layer type no
mask here describes (DeepSeek-V4's compressed attention) is not cut by one either: a target with either runs
each document in a forward of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_drafts.attention.backends import MaskMod

FULL, SLIDING, CHUNKED, LINEAR = (
    "full_attention",
    "sliding_attention",
    "chunked_attention",
    "linear_attention",
)


# The layer types a per-document mask cuts exactly; any other runs each document alone.
MASKED = (FULL, SLIDING, CHUNKED)


@dataclass(frozen=True)
class LayerKind:
    """One decoder layer's attention: ``kind`` (one of :data:`FULL`, :data:`SLIDING`, :data:`CHUNKED`,
    :data:`LINEAR`, or the config's own name of another type) and ``span``, its window or chunk in tokens
    (``None`` for the others)."""

    kind: str
    span: int | None = None

    @property
    def masked(self) -> bool:
        """Whether a per-document attention mask isolates packed documents in this layer."""
        return self.kind in MASKED


def layer_kinds(config: Any) -> list[LayerKind]:
    """Every decoder layer's :class:`LayerKind`, from a transformers text config: its ``layer_types`` where it
    has them (a type other than the four named here kept by its name), else a ``sliding_window`` (Mistral
    applies it on every layer) or full attention."""
    layers = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is None:
        return [LayerKind(SLIDING, int(window)) if window else LayerKind(FULL)] * layers
    kinds = []
    for kind in types[:layers]:
        if kind == SLIDING:
            kinds.append(LayerKind(SLIDING, int(window)))
        elif kind == CHUNKED:
            kinds.append(LayerKind(CHUNKED, int(config.attention_chunk_size)))
        else:
            kinds.append(LayerKind(kind))
    return kinds


def allowed_within_document(kind: LayerKind, q_offset: Tensor, kv_offset: Tensor) -> Tensor:
    """Whether a query ``q_offset`` tokens into its document sees the key ``kv_offset`` tokens into the same
    document (causality and the document itself are the caller's): transformers' sliding-window and chunk
    overlays, counted from the document's start."""
    if kind.kind == SLIDING:
        return kv_offset > q_offset - kind.span
    if kind.kind == CHUNKED:
        return torch.div(kv_offset, kind.span, rounding_mode="floor") == torch.div(
            q_offset, kind.span, rounding_mode="floor"
        )
    return torch.ones_like(q_offset == kv_offset)


def document_kind_mask(kind: LayerKind, doc_ids: Tensor, doc_start: Tensor) -> Tensor:
    """Boolean ``[B, 1, T, T]``: same document, causal, and within ``kind``'s window or chunk of it."""
    width = doc_ids.shape[1]
    index = torch.arange(width, device=doc_ids.device)
    offset = index[None] - doc_start
    same_doc = doc_ids[:, :, None] == doc_ids[:, None, :]
    causal = index[None, :, None] >= index[None, None, :]
    within = allowed_within_document(kind, offset[:, :, None], offset[:, None, :])
    return (same_doc & causal & within)[:, None]


def document_kind_mask_mod(kind: LayerKind, doc_ids: Tensor, doc_start: Tensor) -> MaskMod:
    """The flex ``mask_mod`` of :func:`document_kind_mask`."""

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        same = (doc_ids[b, q_idx] == doc_ids[b, kv_idx]) & (kv_idx <= q_idx)
        start = doc_start[b, q_idx]
        return same & allowed_within_document(kind, q_idx - start, kv_idx - start)

    return mask_mod
