"""A GGUF file's causal LM and tokenizer through transformers' GGUF reader (the ``gguf`` package reads the
file; quantized tensors are dequantized to float32, then cast to the dtype asked for)."""

from __future__ import annotations

import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from lightning_drafts.gguf.files import gguf_location


def load_gguf_model(path: str | os.PathLike, dtype: torch.dtype | None = None) -> PreTrainedModel:
    """The causal LM in the GGUF file ``path``, in ``dtype`` (``None``: float32, what dequantizing gives)."""
    folder, name = gguf_location(path)
    _require_gguf_reader()
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype or torch.float32)


def load_gguf_tokenizer(path: str | os.PathLike) -> PreTrainedTokenizerBase:
    """The tokenizer (vocabulary, merges, special tokens, chat template) stored in the GGUF file ``path``."""
    folder, name = gguf_location(path)
    _require_gguf_reader()
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


def _require_gguf_reader() -> None:
    try:
        import gguf  # noqa: F401
    except ImportError as error:
        raise ImportError(
            "a .gguf target or tokenizer needs the gguf package; install it with "
            '`pip install -e ".[gguf]"` (gguf and accelerate)'
        ) from error
