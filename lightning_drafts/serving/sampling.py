"""Sampled (temperature, top-p) speculative decoding's acceptance rule, which keeps the output distributed
exactly as the target's own sampling.

A round proposes tokens ``x_1..x_k``; the target's distribution ``p_j`` at each proposed position comes
from one verify pass. Standard speculative sampling accepts ``x_j`` with probability ``min(1, p_j(x_j) /
q_j(x_j))`` and, on the first rejection, emits a token drawn from the normalised residual ``max(0, p_j -
q_j)``; after ``k`` acceptances it draws a bonus token from ``p_{k+1}``. The project's speculators propose
deterministically (their argmax), so ``q_j`` is the point mass on ``x_j``: the rule becomes accept with
probability ``p_j(x_j)``, else draw from ``p_j`` with ``x_j`` removed. Either way the emitted token is
distributed as ``p_j``: ``P(x_j) = p_j(x_j)`` and, for ``y != x_j``, ``(1 - p_j(x_j)) p_j(y) / (1 -
p_j(x_j)) = p_j(y)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Sampling:
    """How the target samples: ``temperature`` > 0 scales the logits, ``top_p`` keeps the smallest set of
    most likely tokens whose probability reaches it (nucleus sampling)."""

    temperature: float = 1.0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(
                f"temperature={self.temperature} must be > 0 (greedy decoding takes no Sampling)"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")

    def probabilities(self, logits: Tensor) -> Tensor:
        """The distribution to sample from at each row of ``logits`` ``[..., V]`` (float64)."""
        probs = torch.softmax(logits.double() / self.temperature, dim=-1)
        if self.top_p >= 1:
            return probs
        ordered, order = probs.sort(dim=-1, descending=True)
        # Keep a token while the mass before it is below top_p: the most likely token always stays.
        keep = (ordered.cumsum(-1) - ordered) < self.top_p
        kept = torch.zeros_like(probs).scatter(-1, order, ordered * keep)
        return kept / kept.sum(-1, keepdim=True)


def draw(probs: Tensor, generator: torch.Generator | None) -> int:
    """One token from the distribution ``probs`` ``[V]``."""
    return int(torch.multinomial(probs, 1, generator=generator))


def verify_sampled(
    probs: Tensor, proposal: Tensor, generator: torch.Generator | None
) -> tuple[int, list[int]]:
    """Speculative sampling of one round (module docstring): ``probs[j]`` ``[k + 1, V]`` is the target's
    distribution at proposed position ``j`` (row ``k``: after the whole proposal). Returns how many
    proposed tokens were accepted and the tokens to emit (those, then the residual or bonus token)."""
    for j, token in enumerate(int(t) for t in proposal):
        p = probs[j]
        if float(torch.rand((), generator=generator, dtype=torch.float64)) < float(p[token]):
            continue
        residual = p.clone()
        residual[token] = 0  # max(0, p - q) for q the point mass on the proposed token
        return j, [int(t) for t in proposal[:j]] + [draw(residual / residual.sum(), generator)]
    count = int(proposal.numel())
    return count, [int(t) for t in proposal] + [draw(probs[count], generator)]
