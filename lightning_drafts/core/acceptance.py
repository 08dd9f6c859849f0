"""Acceptance statistics from a draft's ``correct`` / ``valid`` chains, kept as exact integer sums.

A chain is one prediction sequence of K positions (EAGLE-3: one supervised slot over the K TTT steps;
block drafts: one anchor block). ``hits[k]`` counts chains valid at every position up to k whose
predictions 0..k are all correct; ``chain_valid[k]`` counts chains valid at every position up to k.
The acceptance length is NeMo's tau_sim, ``1 + sum_k hits[k] / chain_valid[k]`` over k with a non-zero
denominator: a chain cut short by its document's end leaves the denominator instead of counting as a
miss. Integer sums make the figure exact across ranks and accumulation steps.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torchmetrics import Metric


def prefix_counts(correct: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """``hits[k]`` and ``chain_valid[k]`` (long ``[K]``) from bool ``[M, K]`` chains."""
    if correct.shape != valid.shape or correct.dim() != 2:
        raise ValueError(
            f"correct and valid must both be [M, K], got {tuple(correct.shape)} and {tuple(valid.shape)}"
        )
    hits = (correct & valid).long().cumprod(dim=1).sum(dim=0)
    chain_valid = valid.long().cumprod(dim=1).sum(dim=0)
    return hits, chain_valid


def skip_holes_accept_sums(correct: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """NeMo's DFlash / DFlash2 block acceptance (``compute_accept_len``,
    docs/concepts/dflash.md#block-acceptance) as the exact sums ``(sum over chains with a valid position of 1
    + accepted, number of such chains)``.

    ``accepted = sum_k valid_k prod_{j<=k} (correct_j or not valid_j)``: an unsupervised position inside a
    chain is skipped and counting goes on after it, and a chain whose first position is unsupervised
    still counts. :func:`prefix_counts` stops a chain at its first unsupervised position instead, so
    the two agree exactly when every chain's valid positions form a prefix.
    """
    if correct.shape != valid.shape or correct.dim() != 2:
        raise ValueError(
            f"correct and valid must both be [M, K], got {tuple(correct.shape)} and {tuple(valid.shape)}"
        )
    running = ((correct & valid) | ~valid).long().cumprod(dim=1)
    accepted = (running * valid.long()).sum(dim=1)
    counted = valid.any(dim=1)
    return ((accepted + 1) * counted.long()).sum().double(), counted.sum().double()


def acceptance_length(hits: Tensor, chain_valid: Tensor) -> Tensor:
    """``1 + sum over k with chain_valid[k] > 0 of hits[k] / chain_valid[k]`` (1.0 when nothing is valid)."""
    ratio = hits.double() / chain_valid.double().clamp(min=1)
    return 1.0 + ratio.sum()


class AcceptanceStats(Metric):
    """Per-position accuracy, acceptance length and supervised-token count as integer sums.

    Every state is a long tensor reduced with ``sum``, so the result over ranks equals the result of one
    process that saw all the chains.
    """

    full_state_update = False

    def __init__(self, positions: int) -> None:
        super().__init__()
        self.positions = positions
        for name in ("hits", "chain_valid", "position_correct", "position_valid"):
            self.add_state(name, default=torch.zeros(positions, dtype=torch.long), dist_reduce_fx="sum")
        self.add_state("valid_tokens", default=torch.zeros((), dtype=torch.long), dist_reduce_fx="sum")

    def reset(self) -> None:
        # A validation reset runs under inference mode, whose fresh states a later fit (no_grad) could not
        # update in place: trainer.validate(...) then trainer.fit(...) would fail at fit's validation.
        with torch.inference_mode(False):
            super().reset()

    def update(self, correct: Tensor, valid: Tensor, valid_tokens: Tensor | int | None = None) -> None:
        if correct.shape[1] != self.positions:
            raise ValueError(
                f"expected chains of {self.positions} positions, got shape {tuple(correct.shape)}"
            )
        hits, chain_valid = prefix_counts(correct, valid)
        self.hits += hits
        self.chain_valid += chain_valid
        self.position_correct += (correct & valid).long().sum(dim=0)
        self.position_valid += valid.long().sum(dim=0)
        self.valid_tokens += int(valid.sum()) if valid_tokens is None else valid_tokens

    def compute(self) -> dict[str, Tensor]:
        stats = {"accept_len": acceptance_length(self.hits, self.chain_valid).float()}
        accuracy = self.position_correct.double() / self.position_valid.double().clamp(min=1)
        stats.update({f"acc_pos{k}": accuracy[k].float() for k in range(self.positions)})
        stats["valid_tokens"] = self.valid_tokens.float()
        return stats
