"""PyTorch's fused CPU flash-attention kernel, called directly: the kernel SDPA picks on the CPU, with
its log-sum-exp, for heads of any width.

The kernel takes one head size for queries, keys and values, and MLA's value heads are narrower than its
query and key heads. Zero columns change no score and no kept output, so every head is widened to the
widest and the output cut back. (SDPA itself would fall back to its math kernel there, which keeps a
``[Q, KV]`` score matrix per head: quadratic in the document length.)
"""

from __future__ import annotations

import torch
from torch import Tensor


def cpu_flash_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    scale: float,
    causal: bool = False,
    bias: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``[B, H, Q, d_v]`` attention of ``query [B, H, Q, d]`` over ``key [B, H_kv, KV, d]`` / ``value [B, H_kv,
    KV, d_v]`` (one dtype; ``H_kv`` is ``H`` or, for grouped-query attention, a divisor of it: the kernel reads
    query head ``h``'s keys and values from head ``h // (H / H_kv)``) and its fp32 log-sum-exp ``[B, H, Q]``;
    ``causal``: query ``i`` sees keys ``0..i``; ``bias``: an additive ``[B, 1, Q, KV]`` mask in the queries'
    dtype."""
    value_dim = value.shape[-1]
    dim = max(query.shape[-1], value_dim)
    query, key, value = (_widen(x, dim) for x in (query, key, value))
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, lse = flash(query, key, value, 0.0, causal, attn_mask=bias, scale=scale)
    return out[..., :value_dim], lse.float()


def _widen(x: Tensor, dim: int) -> Tensor:
    return x if x.shape[-1] == dim else torch.nn.functional.pad(x, (0, dim - x.shape[-1]))
