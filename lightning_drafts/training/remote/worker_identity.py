"""Whether a target worker serves the trainer's own target: its identity (see
:meth:`~lightning_drafts.training.remote.target_worker.TargetWorker.identity`) compared field by field with the
trainer's, and the workers' decoder fingerprints with each other.

A worker that differs in any one field computes other features than the co-located target would: another
config, dtype, layer set or attention backend, and also the same config with other weights (a random
target of another seed, a fine-tuned checkpoint). Training on them runs without an error and teaches the
draft a teacher it will never be served with, so the run stops before the first unit is sent.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Identity fields that change the features a worker computes (threads are set by the trainer; the decoder
# fingerprint is compared among the workers, since a trainer without the decoder cannot compute it).
CHECKED_FIELDS = (
    "config_hash",
    "dtype",
    "hidden_size",
    "num_layers",
    "vocab_size",
    "weights",
    "file_sha256",
    "layer_ids",
    "final_positions",
    "attn_backend",
    "torch",
)


def identity_mismatch(index: int, identity: Mapping[str, Any], expected: Mapping[str, Any]) -> str | None:
    """Why worker ``index`` (reporting ``identity``) cannot serve a trainer that expects ``expected``, or
    ``None`` when it can. A field present on one side only differs too (a worker that loaded a GGUF file
    reports its digest; a trainer that did not has none)."""
    for field in CHECKED_FIELDS:
        if identity.get(field) != expected.get(field):
            return (
                f"target worker {index} serves another target: {field} is {identity.get(field)!r} there but "
                f"{expected.get(field)!r} in the trainer; start the workers with the trainer's target, dtype, "
                "layers, attention backend and torch version"
            )
    return None


def fingerprint_mismatch(index: int, identity: Mapping[str, Any], first: Mapping[str, Any]) -> str | None:
    """Why worker ``index``'s decoder differs from worker 0's (``first``), or ``None`` when it does not."""
    if identity["decoder_fingerprint"] == first["decoder_fingerprint"]:
        return None
    return (
        f"target worker {index}'s decoder weights differ from worker 0's (decoder_fingerprint "
        f"{identity['decoder_fingerprint']!r} vs {first['decoder_fingerprint']!r}); every worker must load one "
        "checkpoint"
    )
