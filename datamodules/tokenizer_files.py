"""A tokenizer loaded from a hub id, a ``shipped:<name>`` target or a local folder, refusing a folder that
holds no tokenizer files in one line.

A model's weights folder copied without its tokenizer (``config.json`` and ``model.safetensors`` alone) is
a common mistake; transformers then looks for a slow tokenizer to convert and says to install
sentencepiece or tiktoken, which are installed and would not help. The folder is checked first.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from lightning_drafts.shipped import resolve_shipped

# Files one of which a tokenizer folder holds: a fast tokenizer, a SentencePiece or tiktoken model, or a
# BPE / WordPiece vocabulary.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "vocab.json",
    "vocab.txt",
    "*.tiktoken",
)


def load_tokenizer(spec: str, option: str = "tokenizer") -> PreTrainedTokenizerBase:
    """The tokenizer at ``spec`` (a hub id, a folder, ``shipped:<name>``); ``option`` is the setting that
    named it, for the message that refuses a folder without tokenizer files."""
    location = resolve_shipped(str(spec))
    folder = Path(location)
    if folder.is_dir() and not any(any(folder.glob(pattern)) for pattern in TOKENIZER_FILES):
        present = sorted(path.name for path in folder.iterdir())
        shown = ", ".join(present[:6]) + (", ..." if len(present) > 6 else "") if present else "nothing"
        raise ValueError(
            f"{option}={spec!r}: the folder {folder} has no tokenizer files ({', '.join(TOKENIZER_FILES)}; it "
            f"holds {shown}); pass the folder or hub id the model's tokenizer came with, or copy its tokenizer "
            "files into this folder"
        )
    return AutoTokenizer.from_pretrained(location)
