"""The frozen target's CPU attention: each document alone and causal, plugged in as a transformers
attention function.

With ``sdpa`` a transformers model takes one dense ``[B, 1, T, T]`` mask for every layer, and PyTorch's
SDPA turns a boolean mask into a float one of the same size: 5 GiB at a 32k-token row, quadratic in
the row width, for a mask whose packed documents allow a sliver of it. Registered under
:data:`DOCUMENT_ATTENTION` in transformers' ``AttentionInterface`` (its own extension point), the model
instead hands every layer's queries, keys and values to :func:`document_target_attention`, which reads the
``(row, start, stop)`` span of every document's real tokens from the forward's keyword arguments
(transformers passes them to the attention function untouched) and runs PyTorch's fused CPU flash kernel,
the one SDPA picks on the CPU, once per document with its causal flag: the kernel skips the masked half
itself, no mask is built (a sliding-window or chunked layer gets its pattern as a mask of the document's own
size, counted from the document's start, as the model applies it to the document alone), and padding costs
no attention (its output is zero; no real token reads a
padding slot). Transformers builds no mask of its own for an implementation its mask interface does not
know. :class:`~lightning_drafts.training.target.FrozenTarget` first gathers the micro-batch's real tokens
into one row, so its spans are documents of that row and the linear layers skip the padding too.

A document's attention then depends on that document alone: never on the documents packed beside it or
the rows batched with it, so a capture and the fit that reads its features (which batch rows otherwise)
compute it alike, and float32 features are the online ones exactly. The price is one kernel call per
document and layer: rows of thousands of very short documents spend their attention time in Python.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from transformers import AttentionInterface

from lightning_drafts.attention.backends import additive_mask, one_dtype
from lightning_drafts.attention.cpu_flash import cpu_flash_attention
from lightning_drafts.attention.kv_heads import query_groups
from lightning_drafts.attention.layer_kinds import (
    FULL,
    SLIDING,
    LayerKind,
    allowed_within_document,
    layer_kinds,
)

DOCUMENT_ATTENTION = "lightning_drafts_documents"
# The keyword argument of the model's forward that carries the spans down to every layer.
SPANS_ARGUMENT = "document_spans"


def document_target_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """One layer's attention ``[B, T, H, d_v]``: each ``document_spans`` entry ``(row, start, stop)`` attends
    causally to itself alone (the target is frozen and runs in eval mode: no dropout, no attention weights)."""
    spans = kwargs.get(SPANS_ARGUMENT)
    if not isinstance(spans, tuple):
        raise ValueError(
            f"the {DOCUMENT_ATTENTION!r} attention needs the (row, start, stop) span of every document as the "
            f"forward's {SPANS_ARGUMENT!r} argument, got {type(spans).__name__}; run the target through "
            "FrozenTarget"
        )
    if dropout:
        raise ValueError(f"the frozen target's attention runs without dropout, got dropout={dropout}")
    kinds = {"softcap": "logit soft-capping", "s_aux": "attention sinks"}
    asked = [kind for name, kind in kinds.items() if kwargs.get(name) is not None]
    if asked:
        raise ValueError(
            f"the frozen target's per-document CPU attention (attn_backend='sdpa' on the CPU) has no "
            f"{' or '.join(asked)}, which the target's layers apply; run the target with attn_backend='eager'"
        )
    kind = _layer_kind(module, kwargs)
    batch, _, width, _ = query.shape
    if spans and (max(row for row, _, _ in spans) >= batch or max(stop for _, _, stop in spans) > width):
        raise ValueError(
            f"document_spans {spans[:4]}{' ...' if len(spans) > 4 else ''} do not fit this layer's batch of "
            f"{batch} rows of {width} tokens; build them from the same batch (FrozenTarget does)"
        )
    # Grouped-query heads go to the kernel as they are (checked to divide the query heads): it reads query
    # head h's keys from head h // groups, as transformers' repeat_kv lays them out, without a repeated copy.
    query_groups(query, key)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    # Under bf16-mixed autocast the rotary embedding leaves queries and keys float32 beside bf16 values;
    # SDPA, an autocast op, computes in bf16 there, and so does this (the fused kernel wants one dtype).
    query, key, value = one_dtype(query, key, value)
    out = value.new_zeros(batch, width, query.shape[1], value.shape[-1])
    for row, start, stop in spans:
        piece = slice(start, stop)
        attended, _ = cpu_flash_attention(
            query[row : row + 1, :, piece],
            key[row : row + 1, :, piece],
            value[row : row + 1, :, piece],
            scale,
            causal=kind.kind == FULL,
            bias=None if kind.kind == FULL else _within_document_bias(kind, stop - start, query),
        )
        out[row, piece] = attended[0].transpose(0, 1)
    return out, None


def _layer_kind(module: nn.Module, kwargs: dict[str, Any]) -> LayerKind:
    """The layer's attention pattern: the window transformers passes a sliding layer, else the layer's type
    in its config (a chunked layer passes nothing: its chunks live in the mask it no longer gets)."""
    window = kwargs.get("sliding_window")
    if window is not None:
        return LayerKind(SLIDING, int(window))
    config, index = getattr(module, "config", None), getattr(module, "layer_idx", None)
    if config is not None and index is not None:
        return layer_kinds(config)[index]
    return LayerKind(FULL)


def _within_document_bias(kind: LayerKind, length: int, query: Tensor) -> Tensor:
    """The additive ``[1, 1, n, n]`` mask of one ``length``-token document under a window or chunk ``kind``:
    document-sized, never the row's."""
    offset = torch.arange(length, device=query.device)
    allowed = (offset[:, None] >= offset[None, :]) & allowed_within_document(
        kind, offset[:, None], offset[None, :]
    )
    return additive_mask(allowed[None, None], query.dtype)


AttentionInterface.register(DOCUMENT_ATTENTION, document_target_attention)
