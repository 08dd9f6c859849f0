"""DFlash2's pairwise path selector: re-ranks each slot's top-K candidates given the previous token.

Drafting every slot by its own argmax lets neighbours disagree; the selector scores candidate ``b``
at slot t after predecessor ``a`` as ``U_t(b) + <A[a] * P(h_t), B[b]>``
(docs/concepts/dflash.md#path-selector), with ``U`` the draft's logits, ``A`` / ``B`` the predecessor /
successor codebooks and ``P`` a projection of the slot's final hidden state. The successor codebook starts at
zero, so a fresh selector ranks exactly like the logits. Only the decode walk is sequential, and it touches no
backbone work.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_drafts.dflash.rules import SELECTOR_RANK


class CandidateSelector(nn.Module):
    """Parameter names and shapes are the published layout (``candidate_selector.*`` in exports)."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, initializer_range: float = 0.02) -> None:
        super().__init__()
        SELECTOR_RANK.check(rank)
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        nn.init.normal_(self.hidden_projection.weight, std=initializer_range)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Pair terms vanish at init (zero successor codebook); the projection keeps its own draw."""
        with torch.no_grad():
            nn.init.normal_(self.predecessor_codebook, std=0.02)
            self.successor_codebook.zero_()

    def scores(self, hidden: Tensor, unary: Tensor, candidates: Tensor, predecessor: Tensor) -> Tensor:
        """fp32 ``[..., K]`` scores of ``candidates [..., K]`` (their logits ``unary``) after ``predecessor [...]``."""
        query = _rows(self.predecessor_codebook, predecessor).float() * self.hidden_projection(hidden).float()
        pair = (_rows(self.successor_codebook, candidates).float() * query.unsqueeze(-2)).sum(-1)
        return unary.float() + pair

    @torch.no_grad()
    def greedy_walk(self, hidden: Tensor, unary: Tensor, candidates: Tensor, first: Tensor) -> Tensor:
        """The decode-time greedy path: ``[M, D]`` picks, slot t conditioned on the pick at t - 1.

        ``hidden [M, D, H]``, ``unary`` / ``candidates [M, D, K]``, ``first [M]`` the anchor token. The
        loop runs over the D slots of a block (inherently sequential), each step vectorised over blocks.
        """
        projected = self.hidden_projection(hidden).float()
        successors = self.successor_codebook[candidates].float()
        predecessor, picks = first, []
        for slot in range(candidates.shape[1]):
            query = self.predecessor_codebook[predecessor].float() * projected[:, slot]
            score = unary[:, slot].float() + (successors[:, slot] * query[:, None]).sum(-1)
            predecessor = candidates[:, slot].gather(1, score.argmax(-1, keepdim=True)).squeeze(1)
            picks.append(predecessor)
        return torch.stack(picks, dim=1) if picks else candidates[..., 0]


def _rows(codebook: Tensor, ids: Tensor) -> Tensor:
    """``codebook[ids]`` (``[..., r]``) as ``index_select``: its backward adds the rows' gradients into the
    ``[V, r]`` table in one pass, where advanced indexing's accumulating ``index_put`` takes several times as
    long on the CPU (the same sums, in the same order)."""
    return codebook.index_select(0, ids.reshape(-1)).view(*ids.shape, codebook.shape[-1])


def selector_cross_entropy(
    scores: Tensor, candidates: Tensor, labels: Tensor, weights: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The selector's loss terms: fp32 CE over the K candidate scores toward the gold token, weighted by
    ``weights`` (the objective's: decay or D-PACE, times validity) where the gold token is among the candidates.

    ``scores`` / ``candidates``: ``[..., K]``, ``labels`` / ``weights``: ``[...]`` (chains ``[M, D]``, or the
    flat ``[n]`` positions the module keeps). Returns (weighted CE sum, weight sum, covered ``[...]``); the loss is ``sum / (weight sum + eps)``,
    normalised by its own weights and exactly 0 (never NaN) when no gold token is covered.
    """
    hit = candidates == labels[..., None]
    covered = hit.any(-1)
    ce = torch.nn.functional.cross_entropy(
        scores.float().reshape(-1, scores.shape[-1]), hit.float().argmax(-1).reshape(-1), reduction="none"
    ).view_as(covered)
    weights = weights * covered
    return (ce * weights).sum(), weights.sum(), covered
