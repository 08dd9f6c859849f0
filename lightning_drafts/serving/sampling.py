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

from lightning_drafts.serving.draft_tree import DraftTree


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
    probs: Tensor, tree: DraftTree, generator: torch.Generator | None
) -> tuple[list[int], list[int]]:
    """Speculative sampling of one round over a token tree, SGLang's rule for drafts that propose without
    probabilities (a chain is the tree of one child per node, where it is the module docstring's rule).

    ``probs[0]`` ``[V]`` is the target's distribution after the root, ``probs[1 + i]`` after node ``i``. At
    the current node one uniform coin is drawn and its children are tried in order: the first child whose
    running sum of target probabilities exceeds the coin is accepted, so child ``x`` is accepted with
    probability ``p(x)``. When none is, the emitted token is drawn from ``p`` without the children; at a
    leaf, from ``p``. Either way the token after the current node is distributed as ``p``. Returns the
    accepted nodes (root side first) and the tokens to emit (theirs, then the drawn one).
    """
    parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
    path: list[int] = []
    node = -1
    while children := [i for i, parent in enumerate(parents) if parent == node]:
        p = probs[node + 1]
        coin = float(torch.rand((), generator=generator, dtype=torch.float64))
        mass = torch.cumsum(p[[tokens[c] for c in children]], 0)
        residual = p.clone()
        residual[[tokens[c] for c in children]] = 0
        # Rounding can leave a coin above children that hold all of p's mass: the last of them is then
        # the one the coin falls on.
        hit = [c for c, m in zip(children, mass.tolist(), strict=True) if coin < m]
        if not hit and float(residual.sum()) > 0:
            chosen = draw(residual / residual.sum(), generator)
            return path, [tokens[n] for n in path] + [chosen]
        node = hit[0] if hit else children[-1]
        path.append(node)
    return path, [tokens[n] for n in path] + [draw(probs[node + 1], generator)]
