"""TargetWorker: the frozen target in a process of its own (a Ray actor, see
:mod:`lightning_drafts.training.remote.remote_target`), computing the target features of the micro-batches a
trainer sends it.

It holds the :class:`FrozenTarget` co-located training would hold (same spec, seed, dtype and attention
backend) and runs exactly the packed rows it is sent, so packing stays exact and documents stay isolated
by the same masks. What it returns are the feature keys of :mod:`lightning_drafts.core.target_features`,
laid out as the rows (what a features directory stores), so the trainer's batch simply carries them.
This module never imports Ray: the actor class is made from it where Ray is started.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Hashable, Mapping
from typing import Any

import torch
from torch import Tensor

from lightning_drafts.attention.backends import resolve_backend
from lightning_drafts.core.batch import validate_batch
from lightning_drafts.core.target_features import FeatureRequest
from lightning_drafts.training.target import FrozenTarget, TargetSpec

# Values of each decoder tensor read into the fingerprint: reading a whole large target would take minutes.
FINGERPRINT_VALUES = 4096


class TargetWorker:
    """One target worker.

    Args:
        target, attn_backend, dtype, seed: the :class:`FrozenTarget` arguments (the trainer's own).
        layer_ids, final_positions: the :class:`FeatureRequest` of the draft being trained.
        threads: intra-op threads (the trainer's count, so a float32 forward rounds as the co-located one).
        device: ``"auto"`` (the GPU Ray assigned, else the CPU) or a torch device name.
    """

    def __init__(
        self,
        target: TargetSpec,
        attn_backend: str,
        dtype: str | None,
        seed: int,
        layer_ids: tuple[int, ...],
        final_positions: str,
        threads: int,
        device: str = "auto",
    ) -> None:
        torch.set_num_threads(int(threads))
        self.request = FeatureRequest(tuple(int(i) for i in layer_ids), final_positions)
        self.target = FrozenTarget(target, attn_backend=attn_backend, dtype=dtype, seed=seed)
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.target.to(self.device)

    def identity(self) -> dict[str, Any]:
        """What the features it computes depend on: the target's identity (config hash, dtype, sizes,
        embedding / LM-head digest: what the trainer's own target can check), the layers and final-state
        positions it captures, the attention backend (requested and resolved), the torch version, and a
        fingerprint of the decoder weights (workers of one run must agree on it)."""
        decoder = hashlib.sha256()
        for name, tensor in sorted(self.target.decoder_layers.state_dict().items()):
            decoder.update(name.encode() + b"\0")
            values = tensor.detach().reshape(-1)[:FINGERPRINT_VALUES].float().cpu()
            decoder.update(values.numpy().tobytes())
        return {
            **self.target.identity(),
            "layer_ids": list(self.request.layer_ids),
            "final_positions": self.request.final_positions,
            "attn_backend": self.target.requested_backend,
            "resolved_backend": resolve_backend(self.target.requested_backend, self.device),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "decoder_fingerprint": decoder.hexdigest()[:32],
        }

    def pid(self) -> int:
        """Its process id (what a test kills)."""
        return os.getpid()

    @torch.no_grad()
    def features(self, unit: Hashable, batch: Mapping[str, Tensor]) -> tuple[Hashable, dict[str, Tensor]]:
        """``(unit, features)`` of the micro-batch ``batch`` (the contract keys of its rows), on the CPU."""
        packed = validate_batch(
            {key: value.to(self.device) for key, value in batch.items()}, vocab_size=self.target.vocab_size
        )
        features = self.target.features(packed, self.request)
        return unit, {key: value.cpu() for key, value in features.items()}
