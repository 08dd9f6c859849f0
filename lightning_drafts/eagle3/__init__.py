"""EAGLE-3 draft training: the dense Llama-style draft and the DeepSeek MLA draft."""

from lightning_drafts.eagle3.export import export_draft
from lightning_drafts.eagle3.module import Eagle3Base, Eagle3Module, MLAEagle3Module
from lightning_drafts.eagle3.reload import load_eagle3, load_exported_draft
from lightning_drafts.eagle3.vocab_mapping import VocabMapping, build_vocab_mapping, count_supervised_tokens

__all__ = [
    "Eagle3Base",
    "Eagle3Module",
    "MLAEagle3Module",
    "VocabMapping",
    "build_vocab_mapping",
    "count_supervised_tokens",
    "export_draft",
    "load_eagle3",
    "load_exported_draft",
]
