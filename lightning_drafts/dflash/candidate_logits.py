"""DFlash2's selector candidates: each slot's top-K logits, differentiable through those K head rows only.

The selector loss is normalised by a sum known only after every chunk, so it keeps a gradient of its
own; through the full ``[n, V]`` logits that would be a second vocabulary-wide backward. The candidates'
logits are ``z_k = <W[c_k], h>`` (+ bias), so ``d / d h = sum_k g_k W[c_k]``: one weighted row sum per
slot (``embedding_bag``), with no ``[n, K, H]`` copy of the rows in forward or backward.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from lightning_drafts.core.row_top import row_topk


def candidate_logits(
    logits: Tensor, states: Tensor, head_weight: Tensor, top_k: int
) -> tuple[Tensor, Tensor]:
    """The top-``top_k`` values ``[n, K]`` of ``logits [n, V]`` and their ids, the values differentiable in
    the states ``[n, H]`` those logits were projected from by the frozen head ``head_weight [V, H]``."""
    values, candidates = row_topk(logits.detach(), top_k)
    if not (torch.is_grad_enabled() and states.requires_grad):
        return values, candidates
    return _ThroughRows.apply(values, states, head_weight.detach(), candidates), candidates


class _ThroughRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values: Tensor, states: Tensor, weight: Tensor, candidates: Tensor) -> Tensor:
        ctx.save_for_backward(weight, candidates)
        ctx.dtype = states.dtype
        return values.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        weight, candidates = ctx.saved_tensors
        rows = torch.nn.functional.embedding_bag(
            candidates, weight, mode="sum", per_sample_weights=grad.to(weight.dtype)
        )
        return None, rows.to(ctx.dtype), None, None
