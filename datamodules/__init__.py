"""Chat data for draft training: formatting, tokenisation, packing and the LightningDataModule."""

from datamodules.datamodule import PackedChatDataModule
from datamodules.embedded import embedded_corpus_rows, load_embedded_tokenizer

__all__ = ["PackedChatDataModule", "embedded_corpus_rows", "load_embedded_tokenizer"]
