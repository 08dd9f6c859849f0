"""The probe family's training module: :class:`~tests.support.probe_draft.NextTokenProbe` made servable."""

from __future__ import annotations

from pathlib import Path

from torch import Tensor

from lightning_drafts.core.draft_output import DraftOutput
from tests.families.probe.export import ARCHITECTURE, write_probe_export
from tests.support.probe_draft import NextTokenProbe


class ProbeDraft(NextTokenProbe):
    """A linear head on the target's layer-2 output, proposing one token per round."""

    architecture = ARCHITECTURE

    def compute_loss(self, batch, anchors: Tensor | None = None) -> DraftOutput:
        # Every supervised position is a chain; anchors meant for a block draft must not pass unnoticed.
        if anchors is not None:
            raise ValueError("ProbeDraft takes no anchors: every supervised position starts a chain")
        return super().compute_loss(batch)

    def position_logits(self, batch) -> Tensor:
        """``[B, T, V]`` head logits at every position (what document isolation is checked on)."""
        packed = self.prepare_batch(batch)
        return self.head(self.target(packed, self.target_layer_ids).hidden_states[0])

    def export(self, output_dir: str | Path) -> Path:
        return write_probe_export(self, output_dir)
