"""The end of a command's process group."""

from __future__ import annotations


def end_process_group() -> None:
    """Destroy the process group, if one is up, before the interpreter exits. Lightning destroys an NCCL
    group at exit but leaves a gloo one (CPU DDP) to the interpreter's teardown, where its threads can abort
    the finished process ("terminate called without an active exception", exit status -6)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
