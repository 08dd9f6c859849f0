"""EAGLE tree drafting as SGLang runs it (``--speculative-num-steps``, ``--speculative-eagle-topk``,
``--speculative-num-draft-tokens``): the tree's shape, its growth from a draft's log-probabilities, its
attention mask and its greedy acceptance.

Growth (:func:`grow_tree`), scored by cumulative draft log-probability (SGLang multiplies probabilities:
the same order):

* depth 1: the ``topk`` best tokens of the draft's first distribution; they are the current leaves;
* depths ``2 .. num_steps``: the draft continues every current leaf, each leaf gets its ``topk`` best
  children, and the ``topk`` best of those ``topk**2`` children become the next leaves;
* the tree: the root (the last verified token) and the ``num_draft_tokens - 1`` best nodes of everything
  drafted, ``topk + (num_steps - 1) * topk**2`` candidates. A child's score is its parent's plus a
  log-probability <= 0, and ties go to the earlier candidate (parents are drafted before their children),
  so every kept node's parent is kept.

Verification: one target pass over the context and every node, each node attending to the context and to
its ancestors and itself (:meth:`DraftTree.ancestor_mask`). Greedy acceptance walks from the root to the
child whose token equals the target's greedy token at the current node, as long as one does
(:meth:`DraftTree.accepted_path`); siblings hold distinct tokens, so the path is unique.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from lightning_drafts.core.checks import check_int
from lightning_drafts.serving.family import VerifiedPrefix


@dataclass(frozen=True)
class TreeShape:
    """SGLang's three tree settings; ``topk=1`` with ``num_draft_tokens = num_steps + 1`` is a chain."""

    num_steps: int
    topk: int
    num_draft_tokens: int

    def __post_init__(self) -> None:
        check_int("num_steps", self.num_steps, 1, hint="tree depth (--speculative-num-steps)")
        check_int("topk", self.topk, 1, hint="children kept per leaf (--speculative-eagle-topk)")
        check_int(
            "num_draft_tokens",
            self.num_draft_tokens,
            2,
            self.candidates + 1,
            hint=f"the root plus at most the {self.candidates} drafted candidates of num_steps="
            f"{self.num_steps}, topk={self.topk} (--speculative-num-draft-tokens)",
        )

    @property
    def candidates(self) -> int:
        """Nodes drafted before the best ``num_draft_tokens - 1`` are kept."""
        return self.topk + (self.num_steps - 1) * self.topk**2

    @classmethod
    def chain(cls, num_steps: int) -> TreeShape:
        return cls(num_steps, 1, num_steps + 1)

    def label(self) -> str:
        return f"steps {self.num_steps}, topk {self.topk}, draft tokens {self.num_draft_tokens}"


@dataclass(frozen=True)
class DraftTree:
    """The drafted nodes below the root, parents before children.

    Attributes:
        tokens: long ``[N]``, target vocabulary ids.
        parents: long ``[N]``, the index of each node's parent among the nodes, ``-1`` for the root.
        scores: ``[N]`` each node's cumulative draft log-probability, when the drafter scored it.
    """

    tokens: Tensor
    parents: Tensor
    scores: Tensor | None = None

    @classmethod
    def chain(cls, tokens: Tensor) -> DraftTree:
        """A chain proposal as a tree: node ``j``'s parent is node ``j - 1``."""
        return cls(tokens, torch.arange(tokens.numel(), device=tokens.device) - 1)

    def is_chain(self) -> bool:
        return bool(
            (self.parents == torch.arange(self.parents.numel(), device=self.parents.device) - 1).all()
        )

    def depths(self) -> Tensor:
        """long ``[N]``: 1 for the root's children."""
        depth = torch.zeros_like(self.parents)
        for node, parent in enumerate(self.parents.tolist()):
            depth[node] = 1 if parent < 0 else depth[parent] + 1
        return depth

    def ancestor_mask(self) -> Tensor:
        """bool ``[N, N]``: node ``i`` may attend to node ``j`` iff ``j`` is ``i`` or one of its ancestors."""
        count = self.parents.numel()
        mask = torch.eye(count, dtype=torch.bool, device=self.parents.device)
        for node, parent in enumerate(self.parents.tolist()):
            if parent >= 0:
                mask[node] |= mask[parent]
        return mask

    def accepted_path(self, root_check: int, node_checks: Tensor) -> list[int]:
        """The nodes greedy verification accepts, root side first. ``root_check`` is the target's greedy
        token after the root, ``node_checks[i]`` its greedy token after node ``i``."""
        path: list[int] = []
        check = root_check
        parents, tokens = self.parents.tolist(), self.tokens.tolist()
        parent = -1
        while True:
            child = next((i for i, p in enumerate(parents) if p == parent and tokens[i] == check), None)
            if child is None:
                return path
            path.append(child)
            parent, check = child, int(node_checks[child])


@runtime_checkable
class TreeSpeculator(Protocol):
    """A speculator that can also draft trees (EAGLE-3)."""

    num_steps: int
    target_layer_ids: tuple[int, ...]

    def propose_tree(self, prefix: VerifiedPrefix, shape: TreeShape) -> DraftTree:
        """The tree of ``shape`` continuing ``prefix.tokens``, in target ids."""
        ...


def grow_tree(
    first: Tensor,
    advance: Callable[[Tensor, Tensor], Tensor],
    shape: TreeShape,
    to_target: Callable[[Tensor], Tensor],
) -> DraftTree:
    """The tree of ``shape`` (module docstring) from draft log-probabilities.

    Args:
        first: ``[V_d]`` the draft's log-probabilities at depth 1.
        advance: ``(tokens [k], rows [k]) -> [k, V_d]`` the draft's log-probabilities one depth further
            for ``k`` leaves holding target ids ``tokens``, leaf ``i`` continuing row ``rows[i]`` of the
            draft's previous call (row 0: the context, before the first call).
        to_target: draft ids to target ids.
    """
    topk = shape.topk
    if topk > first.numel():
        raise ValueError(f"topk={topk} exceeds the draft vocabulary of {first.numel()} tokens")
    scores, draft_ids = _best(first, topk)
    pool_scores, pool_ids, pool_parents = [scores], [draft_ids], [torch.full_like(draft_ids, -1)]
    leaves = torch.arange(topk, device=first.device)  # pool indices of the current leaves
    rows = torch.zeros_like(leaves)
    leaf_scores, leaf_ids = scores, draft_ids
    for _ in range(1, shape.num_steps):
        child_scores, child_ids = _best(advance(to_target(leaf_ids), rows), topk)  # [topk, topk] each
        child_scores = (leaf_scores[:, None] + child_scores).flatten()
        child_ids = child_ids.flatten()
        first_child = sum(s.numel() for s in pool_scores)
        pool_scores.append(child_scores)
        pool_ids.append(child_ids)
        pool_parents.append(leaves.repeat_interleave(topk))
        leaf_scores, chosen = _best(child_scores, topk)
        leaf_ids, rows, leaves = child_ids[chosen], chosen // topk, first_child + chosen
    kept = _best(torch.cat(pool_scores), shape.num_draft_tokens - 1)[1].sort().values
    # Pool index -> node index (-1 stays the root): kept holds every kept node's parent (docstring).
    node_of = torch.full((kept.max().item() + 1,), -1, dtype=torch.long, device=kept.device)
    node_of[kept] = torch.arange(kept.numel(), device=kept.device)
    pool_parent = torch.cat(pool_parents)[kept]
    parents = torch.where(pool_parent < 0, pool_parent, node_of[pool_parent.clamp(min=0)])
    if bool(((pool_parent >= 0) & (parents < 0)).any()):
        raise ValueError(
            f"a kept draft node lost its parent (scores {torch.cat(pool_scores).tolist()}): the draft's "
            "log-probabilities must be finite and <= 0"
        )
    return DraftTree(to_target(torch.cat(pool_ids)[kept]), parents, torch.cat(pool_scores)[kept])


def _best(values: Tensor, count: int) -> tuple[Tensor, Tensor]:
    """The ``count`` largest of each row of ``values`` and their indices, ties to the lower index."""
    ordered, order = values.sort(dim=-1, descending=True, stable=True)
    return ordered[..., :count], order[..., :count]
