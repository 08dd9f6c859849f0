"""What names a GGUF file, where transformers finds it, and the digest that identifies its content."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

GGUF_SUFFIX = ".gguf"
# Read in 16 MiB pieces: a multi-gigabyte file is hashed without holding it in memory.
READ_BYTES = 16 * 2**20


def is_gguf(spec: object) -> bool:
    """Whether ``spec`` (a target or tokenizer as a config gives it) names a GGUF file."""
    return isinstance(spec, (str, os.PathLike)) and str(spec).lower().endswith(GGUF_SUFFIX)


def gguf_location(path: str | os.PathLike) -> tuple[str, str]:
    """``(folder, file name)``: how transformers' ``from_pretrained(folder, gguf_file=name)`` reads it. A
    missing file is refused here, with the path, rather than as a hub id transformers would try to fetch."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise FileNotFoundError(
            f"no such GGUF file: {path} (a .gguf target or tokenizer is a local file; check the path in the "
            "config, which is relative to where the command runs)"
        )
    return str(file.resolve().parent), file.name


def file_sha256(path: str | os.PathLike) -> str:
    """The SHA-256 of the file's bytes (hex): a GGUF target's identity, since its weights live in it alone."""
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while piece := stream.read(READ_BYTES):
            digest.update(piece)
    return digest.hexdigest()
