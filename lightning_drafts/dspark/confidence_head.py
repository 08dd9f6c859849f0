"""The DSpark confidence head: a per-slot logit of the probability that the slot's draft is accepted.

At serving time the scheduler reads it to decide how many drafted tokens to verify
(docs/concepts/dspark.md#markov-and-confidence-heads). In training its target is the detached acceptance proxy
``alpha = 1 - TV(draft, target)`` of the slot (objective.py). Its features are NOT detached: the confidence
loss also shapes the backbone and the Markov embedding, as in NeMo.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class ConfidenceHead(nn.Module):
    """``proj``: Linear(D -> 1) with bias (NeMo / SpecForge ``AcceptRatePredictor``), D = H or H + r.

    Args:
        input_dim: H, or H + markov rank when the Markov embedding of the previous token is a feature.
        init_std: std of the normal weight initialisation (the bias starts at 0).
    """

    def __init__(self, input_dim: int, init_std: float = 0.02) -> None:
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)
        nn.init.normal_(self.proj.weight, std=init_std)
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: Tensor, markov_embedded: Tensor | None = None) -> Tensor:
        """fp32 logits ``[M, K]`` from post-norm slot states ``[M, K, H]`` (and ``[M, K, r]`` Markov latents)."""
        features = (
            hidden if markov_embedded is None else torch.cat([hidden, markov_embedded.to(hidden.dtype)], -1)
        )
        return self.proj(features.to(self.proj.weight.dtype)).squeeze(-1).float()
