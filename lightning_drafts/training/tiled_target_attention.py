"""The frozen target's CPU attention: the tiled kernel, plugged in as a transformers attention function.

With ``sdpa`` a transformers model takes one dense ``[B, 1, T, T]`` mask for every layer, and PyTorch's
SDPA turns a boolean mask into a float one of the same size: 5 GiB at a 32k-token row, quadratic in
the row width, for a mask whose packed documents allow a sliver of it. Registered under
:data:`TILED_ATTENTION` in transformers' ``AttentionInterface`` (its own extension point), the model
instead hands every layer's queries, keys and values to :func:`tiled_target_attention`, which reads one
:class:`~lightning_drafts.attention.tiled.TiledMask` per row of the batch from the forward's keyword
arguments (transformers passes them to the attention function untouched) and runs PyTorch's fused CPU
flash kernel per query tile over the keys the tile sees: the same kernel SDPA picks on the CPU, over the
same visible keys. Transformers builds no mask of its own for an implementation its mask interface does
not know.

One mask per row, not one for the batch: a batch's tile is as wide as its widest row's, and the kernel's
sums round differently over another width, while a capture batches rows otherwise than the fit that
reads its features and float32 features must be the online ones exactly.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from transformers import AttentionInterface

from lightning_drafts.attention.backends import masked_attention
from lightning_drafts.attention.tiled import TiledMask

TILED_ATTENTION = "lightning_drafts_tiled"
# The keyword argument of the model's forward that carries the mask down to every layer.
MASK_ARGUMENT = "document_tiles"


def tiled_target_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """One layer's attention ``[B, T, H, d_v]`` under the forward's ``document_tiles`` mask (the target is
    frozen and runs in eval mode: no dropout, no attention weights)."""
    masks = kwargs.get(MASK_ARGUMENT)
    if not (
        isinstance(masks, tuple)
        and len(masks) == query.shape[0]
        and all(isinstance(mask, TiledMask) for mask in masks)
    ):
        raise ValueError(
            f"the {TILED_ATTENTION!r} attention needs one TiledMask per row of the batch (a tuple of "
            f"{query.shape[0]}) as the forward's {MASK_ARGUMENT!r} argument, got {type(masks).__name__}; "
            "run the target through FrozenTarget"
        )
    if dropout:
        raise ValueError(f"the frozen target's attention runs without dropout, got dropout={dropout}")
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        # Query head h reads key head h // groups, as transformers' repeat_kv lays them out.
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    # Under bf16-mixed autocast the rotary embedding leaves queries and keys float32 beside bf16 values;
    # SDPA, an autocast op, computes in bf16 there, and so does this (the fused kernel wants one dtype).
    out = torch.cat(
        [
            masked_attention(query[row : row + 1], key[row : row + 1], value[row : row + 1], mask, scale)
            for row, mask in enumerate(masks)
        ]
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(TILED_ATTENTION, tiled_target_attention)
