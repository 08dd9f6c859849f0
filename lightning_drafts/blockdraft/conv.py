"""DFlash2's in-block convolution: a two-tap dynamic grouped depthwise conv around each sublayer.

It targets "suffix decay" (draft quality falling toward the end of a block) by letting each slot mix
in its in-block predecessor (docs/concepts/dflash.md#in-block-convolution). Taps read only earlier slots of
the **same** block (zero before the block start), so drafting all blocks at once equals drafting one block at
a time. It starts as the identity, so a fresh DFlash2 draft computes exactly what DFlash computes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from lightning_drafts.core.checks import int_problem, is_int
from lightning_drafts.core.rules import FieldRule


def kernel_size_problem(value: Any, block_size: Any = None) -> str | None:
    """Taps are >= 1 and, given the block size, no more than it: taps past the block start read only zeros."""
    problem = int_problem(value, 1, hint="2 is the published default")
    if problem is None and is_int(block_size) and value > block_size:
        return f"{value}; it exceeds block_size {block_size}: taps past the block start read only zeros"
    return problem


def group_size_problem(value: Any, hidden_size: Any) -> str | None:
    """Channels per dynamic-kernel group: a positive divisor of the hidden size."""
    problem = int_problem(value, 1)
    if problem is None and is_int(hidden_size) and hidden_size % value:
        return (
            f"{value}; it must divide hidden_size {hidden_size} (channels per dynamic-kernel group; 16 is "
            "the published default)"
        )
    return problem


CONV_KERNEL_SIZE = FieldRule("conv_kernel_size", kernel_size_problem)
CONV_GROUP_SIZE = FieldRule("conv_group_size", group_size_problem)


class GroupedDynamicConv(nn.Module):
    """``out_t[c] = sum_j (base[j, c] + dyn_t[j, c // group_size]) * x_{t-j}[c]`` inside each block.

    One instance wraps one sublayer: :meth:`prepare` convolves the sublayer input with kernel 0 and
    returns the dynamic coefficients of kernel 1, which :meth:`finish` applies to the sublayer
    output. Both coefficient sets come from the pre-conv sublayer input. Parameter names
    (``base_kernel [2, T, H]``, ``kernel_projection: H -> 2 * T * G``) are the published layout.
    """

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        CONV_KERNEL_SIZE.check(kernel_size)
        CONV_GROUP_SIZE.check(group_size, hidden_size=hidden_size)
        self.kernel_size = kernel_size
        self.group_size = group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The identity: tap 0 passes the slot through, every other tap and the dynamic part are 0."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, blocks: Tensor) -> tuple[Tensor, Tensor]:
        """``blocks [M, bs, H]`` -> (convolved input, the dynamic kernel for :meth:`finish`)."""
        dynamic = self.kernel_projection(blocks).unflatten(-1, (2, self.kernel_size, self.groups))
        return self._convolve(blocks, self.base_kernel[0], dynamic[..., 0, :, :]), dynamic[..., 1, :, :]

    def finish(self, blocks: Tensor, dynamic: Tensor) -> Tensor:
        return self._convolve(blocks, self.base_kernel[1], dynamic)

    def _convolve(self, blocks: Tensor, base: Tensor, dynamic: Tensor) -> Tensor:
        # Channels as [G, group_size], so a group's dynamic coefficient broadcasts over its channels instead
        # of being copied out to them (and unbind's backward stacks the taps' gradients in one op, where a
        # select per tap would fill a whole zero kernel each). Tap j reads slot t - j of the same block.
        grouped = blocks.unflatten(-1, (self.groups, self.group_size))
        kernel = base.to(blocks.dtype).unflatten(-1, (self.groups, self.group_size)) + dynamic[..., None]
        taps = kernel.unbind(2)
        out = taps[0] * grouped
        for tap in range(1, min(self.kernel_size, blocks.shape[1])):
            shifted = nn.functional.pad(grouped[:, :-tap], (0, 0, 0, 0, tap, 0))
            out = out + taps[tap] * shifted
        return out.flatten(-2)
