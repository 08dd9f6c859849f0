"""How close a training step comes to the machine: its model FLOPs per second against the rate of a large
matrix multiply measured in the same process.

Model FLOPs are what the formulas of :class:`torch.utils.flop_counter.FlopCounterMode` count while the
step's forward and backward run: ``2 * m * n * k`` for every matrix product (``mm``, ``addmm``, ``bmm``, ``baddbmm``), the
attention kernels' score and value products (``4 * b * h * q * kv * d`` forward, about 2.5x that backward,
over the whole query x key area a kernel is handed, masked or not), convolutions likewise. Everything else
(softmax, norms, activations, the optimizer's update, gathers) counts 0: on a CPU they are memory-bound, and
the question is how far the products run from the machine's product rate. PyTorch's counter has no formula
for the CPU flash-attention kernel, so :data:`CPU_ATTENTION_FORMULAS` gives it the GPU kernel's.

The limit is a ``size x size`` matrix product in the step's dtype at the same thread count, best of a few
repeats: what this CPU (its vector units, its BLAS) achieves on the most favourable shape. A step's ratio to
it is the distance to that limit, comparable across machines; a ratio well below 1 says the step is bound by
something else (memory-bound elementwise work, small products, Python overhead).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count


def _cpu_flash_forward(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_flash_backward(
    grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs
) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


CPU_ATTENTION_FORMULAS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_forward,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward,
}


def counted_flops(run: Callable[[], object]) -> int:
    """The FLOPs PyTorch's counter formulas give the operators ``run()`` executes (forward and backward)."""
    with _FlopCount() as counter:
        run()
    return counter.total


class _FlopCount(TorchDispatchMode):
    """:class:`FlopCounterMode`'s formulas without its per-module tracker, whose backward hooks refuse the
    ``torch.autograd.grad`` calls the block drafts' chunked vocabulary terms make inside their forward."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.formulas = FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FORMULAS).flop_registry

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = self.formulas.get(func._overloadpacket)
        if formula is not None:
            self.total += int(formula(*args, **kwargs, out_val=out))
        return out


@dataclass(frozen=True)
class MatmulRate:
    """FLOPs per second of a large matrix product, by wall clock and by process CPU time."""

    size: int
    per_second: float
    per_cpu_second: float


def matmul_rate(
    size: int = 2048, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu", repeats: int = 5
) -> MatmulRate:
    """The best of ``repeats`` timed ``size x size`` products (after one untimed), at the current thread count."""
    device = torch.device(device)
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    flops = 2 * size**3
    best_wall = best_cpu = float("inf")
    for repeat in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start, cpu_start = time.perf_counter(), time.process_time()
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        if repeat:
            best_wall, best_cpu = min(best_wall, wall), min(best_cpu, max(cpu, 1e-9))
    return MatmulRate(size, flops / best_wall, flops / best_cpu)
