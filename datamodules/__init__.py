"""Chat data for draft training: formatting, tokenisation, packing and the LightningDataModule."""

from lightning_drafts.datamodules.datamodule import PackedChatDataModule
from lightning_drafts.datamodules.embedded import embedded_corpus_rows, load_embedded_tokenizer

__all__ = ["PackedChatDataModule", "embedded_corpus_rows", "load_embedded_tokenizer"]
