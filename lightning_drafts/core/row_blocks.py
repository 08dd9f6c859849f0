"""Vocabulary-wide work a few rows at a time, so that no ``[n, V]`` temporary is made whole.

A term that reads a shared row per slot (a teacher distribution several slots share, a bigram row per
previous token) would gather an ``[n, V]`` copy first: a fresh allocation as large as the logits, whose pages
the kernel maps anew at every step (on CPU, a page fault per 4 KiB), swept once to write and once to read.
Gathered :data:`ROWS` rows at a time instead, the copy is a small block that stays in cache and that the
allocator hands back at the next block. An accelerator has no page to fault in (its caching allocator keeps
freed memory) but pays a launch per kernel, so there a block is :data:`ACCELERATOR_ROWS` rows: the copy is
bounded all the same, in a few launches per step.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

ROWS = 16
"""Rows per block on CPU: 2 MiB of fp32 at a 32k vocabulary (a core's L2 cache on current server CPUs)."""
ACCELERATOR_ROWS = 1024
"""Rows per block elsewhere (CUDA): 128 MiB of fp32 at a 32k vocabulary."""


def row_blocks(values: Tensor) -> Iterator[slice]:
    """Slices of consecutive rows covering ``values``' first dimension, :data:`ROWS` rows each on CPU and
    :data:`ACCELERATOR_ROWS` on any other device (the last one shorter)."""
    rows, size = values.shape[0], ROWS if values.device.type == "cpu" else ACCELERATOR_ROWS
    for start in range(0, rows, size):
        yield slice(start, min(start + size, rows))


def add_gathered_rows(values: Tensor, rows: Tensor, index: Tensor) -> Tensor:
    """``values[i] += rows[index[i]]`` over the positions ``i`` of contiguous ``values [..., V]`` (``index``
    holds one row id per position, in any shape), written into ``values`` (pass a tensor nothing else reads,
    a projection's fresh output) and returned; ``rows [u, V]`` are cast to ``values``' dtype per block.
    Differentiable in both: ``rows``' gradient is the sum of its positions' gradients, summed in ``rows``'
    dtype."""
    return _AddGatheredRows.apply(values, rows, index)


class _AddGatheredRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values: Tensor, rows: Tensor, index: Tensor) -> Tensor:
        # Flattened here, where autograd records nothing: an in-place write through a view the caller
        # made would have autograd copy the whole base.
        flat, index = values.view(-1, values.shape[-1]), index.reshape(-1)
        for block in row_blocks(flat):
            flat[block] += rows.index_select(0, index[block]).to(values.dtype)
        ctx.mark_dirty(values)
        ctx.save_for_backward(index)
        ctx.rows_shape, ctx.rows_dtype = rows.shape, rows.dtype
        return values

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor | None, None]:
        (index,) = ctx.saved_tensors
        grad_rows = None
        if ctx.needs_input_grad[1]:
            flat = grad.reshape(-1, grad.shape[-1])
            grad_rows = grad.new_zeros(ctx.rows_shape, dtype=ctx.rows_dtype)
            for block in row_blocks(flat):
                grad_rows.index_add_(0, index[block], flat[block].to(ctx.rows_dtype))
        return grad, grad_rows, None
