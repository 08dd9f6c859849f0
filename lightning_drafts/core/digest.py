"""Digests of exact tensor bytes: equal digests mean bit-identical tensors (dtype and shape included).

Checkpoints carry a digest of each of their sections (weights, optimizer state, loops, loader position,
...), so a damaged file is refused on load instead of resuming or exporting wrong numbers; exports
fingerprint a freshly initialised LM head, so the validator can prove the exported one was trained.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np
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


def value_digest(value: Any) -> str:
    """A digest of a checkpoint value: nested mappings (in key order), sequences, tensors (exact bytes) and
    plain values (their ``repr``). Any other object contributes only its type: its ``repr`` may hold a
    memory address, which would differ after a reload."""
    digest = hashlib.sha256()
    _feed(digest, value)
    return digest.hexdigest()


def _feed(digest: hashlib._Hash, value: Any) -> None:
    if isinstance(value, Tensor):
        digest.update(b"T")
        _update(digest, value)
    elif isinstance(value, np.ndarray):
        digest.update(b"N")
        _update(digest, torch.from_numpy(np.ascontiguousarray(value)))
    elif isinstance(value, Mapping):
        digest.update(b"{")
        for key in sorted(value, key=repr):
            _feed(digest, key)
            _feed(digest, value[key])
        digest.update(b"}")
    elif isinstance(value, (list, tuple)):
        digest.update(b"[" if isinstance(value, list) else b"(")
        for item in value:
            _feed(digest, item)
        digest.update(b"]")
    elif value is None or isinstance(value, (str, bytes, bool, int, float, complex, torch.dtype)):
        digest.update(f"{type(value).__name__}:{value!r}\0".encode())
    else:
        digest.update(f"<{type(value).__module__}.{type(value).__qualname__}>\0".encode())
