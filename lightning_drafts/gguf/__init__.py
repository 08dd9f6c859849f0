"""A GGUF file as a target and tokenizer: recognised by its suffix, loaded through transformers' GGUF reader
(dequantized), identified by its bytes' digest, and written out as a plain Hugging Face folder for the
engines that load one."""

from lightning_drafts.gguf.convert import convert_gguf
from lightning_drafts.gguf.files import file_sha256, gguf_location, is_gguf
from lightning_drafts.gguf.load import load_gguf_model, load_gguf_tokenizer

__all__ = [
    "convert_gguf",
    "file_sha256",
    "gguf_location",
    "is_gguf",
    "load_gguf_model",
    "load_gguf_tokenizer",
]
