"""PyTorch's fused CPU flash-attention kernel, called directly: the kernel SDPA picks on the CPU, with
its log-sum-exp, for heads of any width, and with a gradient through that log-sum-exp.

The kernel takes one head size for queries, keys and values, and MLA's value heads are narrower than its
query and key heads. Zero columns change no score and no kept output, so every head is widened to the
widest and the output cut back. (SDPA itself would fall back to its math kernel there, which keeps a
``[Q, KV]`` score matrix per head: quadratic in the document length.)

The kernel's own derivative ignores the log-sum-exp, which EAGLE-3 differentiates (it merges the TTT
diagonal keys through it). Its backward kernel computes the score gradient as ``dS = P * (dP - D)`` with
``D = rowsum(dO * O)``, and ``d lse / d s = P``, so an upstream ``g`` on the log-sum-exp only moves ``D`` to
``D - g``. One more head column carries it: zero in the queries, keys and values (no score, no output
changes), ``-1`` in the output and ``g`` in the output gradient, so the same single backward kernel returns
the exact gradients of both outputs.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable


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
    query head ``h``'s keys and values from head ``h // (H / H_kv)``) and its fp32 log-sum-exp ``[B, H, Q]``,
    both differentiable; ``causal``: query ``i`` sees keys ``0..i``; ``bias``: an additive ``[B, 1, Q, KV]``
    mask in the queries' dtype (no gradient)."""
    value_dim = value.shape[-1]
    dim = max(query.shape[-1], value_dim)
    query, key, value = (_widen(x, dim) for x in (query, key, value))
    out, lse = _FlashAttention.apply(query, key, value, bias, scale, causal)
    return out[..., :value_dim], lse


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, query: Tensor, key: Tensor, value: Tensor, bias: Tensor | None, scale: float, causal: bool
    ) -> tuple[Tensor, Tensor]:
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        out, lse = flash(query, key, value, 0.0, causal, attn_mask=bias, scale=scale)
        ctx.save_for_backward(query, key, value, bias, out, lse)
        ctx.scale, ctx.causal = scale, causal
        ctx.set_materialize_grads(False)
        return out, lse.float()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor | None, grad_lse: Tensor | None) -> tuple[Tensor | None, ...]:
        query, key, value, bias, out, lse = ctx.saved_tensors
        if grad_out is None and grad_lse is None:
            return None, None, None, None, None, None
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        dim = query.shape[-1]
        if grad_lse is not None:
            # The carrier column (module docstring): D' = D + g * (-1).
            query, key, value = (torch.nn.functional.pad(x, (0, 1)) for x in (query, key, value))
            out = torch.cat([out, out.new_full((*out.shape[:-1], 1), -1.0)], dim=-1)
            grad_out = torch.cat([grad_out, grad_lse.to(grad_out.dtype)[..., None]], dim=-1)
        backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        grad_query, grad_key, grad_value = backward(
            grad_out, query, key, value, out, lse, 0.0, ctx.causal, attn_mask=bias, scale=ctx.scale
        )
        return grad_query[..., :dim], grad_key[..., :dim], grad_value[..., :dim], None, None, None


def _widen(x: Tensor, dim: int) -> Tensor:
    return x if x.shape[-1] == dim else torch.nn.functional.pad(x, (0, dim - x.shape[-1]))
