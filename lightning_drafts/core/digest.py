"""Digests of exact tensor bytes: equal digests mean bit-identical tensors (dtype and shape included).

Checkpoints carry the digest of their draft tensors, so a damaged file is refused on load instead of
resuming or exporting zeroed weights; exports fingerprint a freshly initialised LM head, so the validator
can prove the exported one was trained.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch
from torch import Tensor


def _update(digest: hashlib._Hash, tensor: Tensor) -> None:
    data = tensor.detach().to("cpu").contiguous()
    digest.update(f"{data.dtype}:{tuple(data.shape)}".encode())
    if data.numel():
        digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())


def tensor_fingerprint(tensor: Tensor) -> str:
    """A digest of one tensor's exact bytes, dtype and shape."""
    digest = hashlib.sha256()
    _update(digest, tensor)
    return digest.hexdigest()[:32]


def state_digest(state: Mapping[str, Tensor]) -> str:
    """A digest of every tensor of ``state`` with its name, independent of the mapping's order."""
    digest = hashlib.sha256()
    for name in sorted(state):
        digest.update(name.encode() + b"\0")
        _update(digest, state[name])
    return digest.hexdigest()
