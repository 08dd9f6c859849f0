"""Counting the rows of the matrix products that read given weights: the tests' proof that skipped work is
not done."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class RowsThrough(TorchDispatchMode):
    """Rows of every matrix product that reads one of ``weights`` (forward and backward alike), per weight."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.storages = {name: w.untyped_storage().data_ptr() for name, w in weights.items()}
        self.rows = dict.fromkeys(weights, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (
            torch.ops.aten.mm,
            torch.ops.aten.addmm,
            torch.ops.aten.addmm_,
            torch.ops.aten.bmm,
        ):
            read = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
            for name, storage in self.storages.items():
                if storage in read:
                    self.rows[name] += out.numel() // out.shape[-1]
        return out
