"""The validation split of one source: documents held out by a hash of their content.

A split by row position puts the copies of a duplicated document on both sides, and validation then
scores text the draft trained on (chat corpora repeat greetings and whole conversations). Here every
document's tokens and loss mask are hashed with the seed; distinct contents are taken in hash order, and
a content is held out whole (all its copies) while that keeps the held-out count within
``round(fraction * documents)``. So identical documents always land on the same side, the split is the
same on every run and machine for the same seed, and the held-out share is the fraction asked for up to
rounding (a content with more copies than the remaining room is left in training).
"""

from __future__ import annotations

import hashlib

import numpy as np

from lightning_drafts.datamodules.documents import Documents


def content_hashes(documents: Documents, seed: int) -> list[bytes]:
    """One digest per document of its tokens and loss mask, keyed by ``seed``."""
    key = int(seed).to_bytes(8, "little", signed=True)
    digests = []
    for i in range(len(documents)):
        ids, mask = documents.tokens(i)
        digest = hashlib.blake2b(key=key, digest_size=16)
        digest.update(np.ascontiguousarray(ids, dtype=np.int64).tobytes())
        digest.update(np.ascontiguousarray(mask, dtype=np.int8).tobytes())
        digests.append(digest.digest())
    return digests


def split_by_content(documents: Documents, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(train index, held-out index)``, each sorted, of ``documents`` split as the module docstring says
    (at least one document is held out when ``fraction > 0``, unless that would leave none to train on)."""
    digests = content_hashes(documents, seed)
    copies: dict[bytes, list[int]] = {}
    for index, digest in enumerate(digests):
        copies.setdefault(digest, []).append(index)
    wanted = max(1, round(fraction * len(documents))) if fraction > 0 else 0
    held: list[int] = []
    for digest in sorted(copies):
        group = copies[digest]
        if len(held) + len(group) <= wanted:
            held += group
        if len(held) == wanted:
            break
    if not held and wanted and len(copies) > 1:
        # Every content has more copies than asked for: hold out the smallest one rather than nothing.
        held = min(copies.values(), key=len)
    held_out = np.zeros(len(documents), dtype=bool)
    held_out[held] = True
    return np.flatnonzero(~held_out), np.flatnonzero(held_out)
