"""Host reads and kernels of one packed training step of every draft, counted on a CPU.

On CUDA the host queues kernels and runs ahead of the device until it needs a value the device computes:
a scalar read (``.item()``, ``int(t)``, ``bool(t)``, what ``if t.any():`` does), a list (``.tolist()``) or
an operator whose output size depends on the data (``nonzero``, a boolean index, ``masked_select``,
``unique``, ``bincount``, ``repeat_interleave`` without ``output_size``). Each such read waits for every
queued kernel, so the host cannot prepare the next kernels meanwhile: a step's count of them is how often
the device may idle. They are the same operators on a CPU, so the count is taken there: every operator
of the step passes through a dispatch mode (data-dependent operators, scalar reads) and a function mode
(``tolist`` and ``cpu``, which on a CPU tensor run no operator), and each read is named by the line of this
repository that made it. A tensor copied to the host (``.cpu()``, the read) and what is computed from such
tensors alone are host tensors: reading them later waits for nothing and is not counted.

What a CPU step runs that a CUDA step does not is set apart: the CPU's own attention kernels
(:data:`CPU_KERNELS`: the tiled draft attention and the target's per-document attention, whose
syncs are free on a CPU), where CUDA runs flex or flash-attn. Everything else is the code CUDA runs.

The kernel count is every operator the step dispatches that is not a view (a view launches nothing): on a
CPU the attention is a different set of kernels, so it is a measure of the step's elementwise and
bookkeeping work, compared between families and with the same step later.

    .venv/bin/python benchmarks/host_syncs.py                  # every draft, rows of 2,048 and 8,192 tokens
    .venv/bin/python benchmarks/host_syncs.py --drafts dflash --widths 4096 --sites
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import context_step  # noqa: E402

DRAFTS = ("eagle3", "mla_eagle3", "dflash", "dflash2", "dspark")
PACKAGE = "lightning_drafts"
# The CPU's attention kernels, by file (every function) or by (file, function): a CUDA step runs flex or
# flash-attn in their place. A read made anywhere below one of them is the CPU's own.
CPU_KERNELS = {
    "attention/tiled.py": None,
    "attention/cpu_flash.py": None,
    "attention/document_tiles.py": None,
    "attention/query_subset.py": {"tile_subset_causal_mask"},
    "attention/block_masks.py": {"tiled_block_mask", "_block_tiles", "_tile_context_bounds"},
    "training/document_target_attention.py": None,
    "training/target.py": {"_forward_documents", "_documents_in_one_row"},
}
_aten = torch.ops.aten
# Operators whose output size depends on the data, or that read a scalar back: a CUDA host waits for them.
DATA_DEPENDENT = {
    _aten._local_scalar_dense.default: "scalar read",
    _aten.nonzero.default: "nonzero",
    _aten.masked_select.default: "masked_select",
    _aten._unique2.default: "unique",
    _aten.unique_dim.default: "unique",
    _aten.unique_consecutive.default: "unique",
    _aten.bincount.default: "bincount",
    _aten.repeat_interleave.Tensor: "repeat_interleave",
}
INDEXING = {
    _aten.index.Tensor,
    _aten.index_put_.default,
    _aten.index_put.default,
    _aten._index_put_impl_.default,
}


def _site() -> tuple[str, bool]:
    """``path:line`` of the innermost frame of this repository's package on the stack, and whether a
    frame of the CPU's own attention kernels is on it."""
    site, cpu_kernel = "outside the package", False
    for frame in reversed(traceback.extract_stack()):
        path = frame.filename.replace("\\", "/")
        if f"/{PACKAGE}/" not in path:
            continue
        relative = path.rsplit(f"/{PACKAGE}/", 1)[1]
        if site == "outside the package":
            site = f"{PACKAGE}/{relative}:{frame.lineno}"
        functions = CPU_KERNELS.get(relative, ())
        cpu_kernel = cpu_kernel or functions is None or frame.name in functions
    return site, cpu_kernel


# Set on a tensor the step copied to the host (``.cpu()``) and on what is computed from such tensors alone:
# reading those waits for nothing.
ON_HOST = "_counted_on_host"


def _on_host(tensor: Any) -> bool:
    return getattr(tensor, ON_HOST, False)


class _Reads(TorchDispatchMode):
    def __init__(self, record: HostSyncs) -> None:
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if inputs and all(_on_host(t) for t in inputs):
            out = func(*args, **kwargs)
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    setattr(t, ON_HOST, True)
            return out
        kind = DATA_DEPENDENT.get(func)
        if kind == "repeat_interleave" and kwargs.get("output_size") is not None:
            kind = None
        if func in INDEXING and any(i is not None and i.dtype == torch.bool for i in args[1]):
            kind = "boolean index"
        if kind is not None:
            self.record.add(kind)
        if not any(ret.alias_info is not None for ret in func._schema.returns):
            self.record.kernels += 1
        return func(*args, **kwargs)


class _Lists(TorchFunctionMode):
    def __init__(self, record: HostSyncs) -> None:
        super().__init__()
        self.record = record

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.tolist, torch.Tensor.cpu) and not _on_host(args[0]):
            self.record.add(func.__name__)
        out = func(*args, **(kwargs or {}))
        if func is torch.Tensor.cpu:
            # On a CPU ``.cpu()`` returns the tensor itself: from here on it stands for the host's copy.
            setattr(out, ON_HOST, True)
        return out


class HostSyncs:
    """Within ``with HostSyncs() as syncs:``: ``syncs.reads`` counts each host read a CUDA step makes too
    by (kind, site), ``syncs.cpu_kernel_reads`` those of the CPU's own attention kernels, and
    ``syncs.kernels`` the non-view operators dispatched."""

    def __init__(self) -> None:
        self.reads: Counter[tuple[str, str]] = Counter()
        self.cpu_kernel_reads = 0
        self.kernels = 0
        self._modes = (_Lists(self), _Reads(self))

    def add(self, kind: str) -> None:
        site, cpu_kernel = _site()
        if cpu_kernel:
            self.cpu_kernel_reads += 1
        else:
            self.reads[(kind, site)] += 1

    @property
    def total(self) -> int:
        """The reads a CUDA step makes too."""
        return sum(self.reads.values())

    def __enter__(self) -> HostSyncs:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


def step_reads(draft: str, width: int, targets: str = "tiny", seed: int = 0) -> HostSyncs:
    """The host reads and kernels of one training step (the draft's ``compute_loss`` with its target
    forward, and the backward) of ``draft``'s quickstart settings on one packed row of ``width`` tokens."""
    module, batch, anchors = context_step.prepared(draft, width, targets, seed, "cpu")
    with HostSyncs() as syncs:
        output = module.compute_loss(batch, anchors=anchors)
        output.loss.backward()
    return syncs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--drafts", nargs="+", default=list(DRAFTS), choices=DRAFTS)
    parser.add_argument("--widths", nargs="+", type=int, default=[2048, 8192])
    parser.add_argument("--targets", choices=("tiny", "shipped"), default="tiny")
    parser.add_argument("--sites", action="store_true", help="list every read by its line")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}; {args.targets} targets; one packed row per step")
    print("| draft | row width | host reads (CUDA path) | of which in the CPU's attention | kernels |")
    print("|---|---:|---:|---:|---:|")
    listed = {}
    for draft in args.drafts:
        for width in args.widths:
            syncs = step_reads(draft, width, args.targets)
            print(
                f"| {draft} | {width:,} | {syncs.total} | {syncs.cpu_kernel_reads} | {syncs.kernels:,} |",
                flush=True,
            )
            listed[(draft, width)] = syncs.reads
    if args.sites:
        for (draft, width), reads in listed.items():
            print(f"\n{draft} at {width:,} tokens:")
            for (kind, site), count in sorted(reads.items(), key=lambda item: item[0][1]):
                print(f"  {count:3d} x {kind:17s} {site}")


if __name__ == "__main__":
    main()
