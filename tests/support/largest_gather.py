"""A dispatch mode that records the largest ``index_select`` output and every ``clone``: a gather made
whole, or the copy autograd makes of a tensor written in place through a view, shows in it."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class LargestGather(TorchDispatchMode):
    """The most elements any ``index_select`` produced, and how many ``clone`` calls ran."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0
        self.clones = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket is torch.ops.aten.index_select:
            self.largest = max(self.largest, out.numel())
        elif func.overloadpacket is torch.ops.aten.clone:
            self.clones += 1
        return out
