"""DSpark: the block drafter with a Markov head and a confidence head (docs/concepts/dspark.md)."""

from lightning_drafts.dspark.export import export_draft
from lightning_drafts.dspark.module import DSparkModule
from lightning_drafts.dspark.reload import load_exported_draft

__all__ = ["DSparkModule", "export_draft", "load_exported_draft"]
