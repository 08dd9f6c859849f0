"""A minimal draft for testing the shared DraftModule machinery without any draft family."""

from __future__ import annotations

import torch
from torch import nn

from lightning_drafts import DraftModule, DraftOutput


class NextTokenProbe(DraftModule):
    """The smallest draft: a linear head on one captured layer predicting the target's greedy next token."""

    target_layer_ids = (2,)

    def __init__(self, target: dict, learning_rate: float = 1e-2, **kwargs) -> None:
        super().__init__(target=target, learning_rate=learning_rate, **kwargs)
        self.head = nn.Linear(self.target.text_config.hidden_size, self.target.vocab_size)

    def compute_loss(self, batch, anchors=None) -> DraftOutput:
        packed = self.prepare_batch(batch)
        out = self.target(packed, self.target_layer_ids)
        teacher = self.target.greedy_tokens(out.last_hidden_state)
        logits = self.head(out.hidden_states[0])
        supervised = packed.loss_mask
        loss = nn.functional.cross_entropy(logits[supervised], teacher[supervised])
        correct = (logits.argmax(-1) == teacher)[supervised][:, None]
        return DraftOutput(loss=loss, correct=correct, valid=torch.ones_like(correct))
