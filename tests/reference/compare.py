"""What the reference tests share: the batches both implementations see, a short warm-up that makes the
draft predict some tokens right (so the statistics compared are not all zero), and the comparisons.

Tolerances are fp32 round-off of two implementations that sum in different orders: loss within 5e-6
absolute plus 1e-6 relative (measured: <= 1.4e-6), every gradient within 1e-4 of its norm, or of 1% of the
whole draft gradient's norm where its own is smaller (measured: <= 1.3e-5 of its own norm for every tensor
but EAGLE-3's query and key projections, whose gradients are ~1e-3 of the whole: there the same ~5e-8 of
round-off every tensor shows is up to 1.4e-4 of their own norm on one CPU and 1e-5 on another). A real
objective bug (a wrong weight, a shifted label, a missing term) moves them by orders of magnitude more;
the statistics are integer counts and must be equal.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from benchmarks.nemo_reference import gradient_pairs
from lightning_drafts.core.batch import PackedBatch, validate_batch
from tests.support.builders import packed_row, padded_rows, stack_rows

LOSS_ATOL, LOSS_RTOL = 5e-6, 1e-6
GRAD_RTOL = 1e-4
# The floor on a gradient's scale, as a fraction of the whole draft gradient's norm: round-off is absolute,
# so a tensor whose gradient is nearly zero is compared at this scale instead of its own.
GRAD_FLOOR = 1e-2


def documents(vocab: int) -> list[torch.Tensor]:
    """Three documents a draft learns quickly (two repeat a short pattern, so its predictions turn right
    within a few steps) and one it cannot (random tokens): hits and misses, at several depths."""
    gen = torch.Generator().manual_seed(7)
    pattern_a = torch.randint(3, vocab, (3,), generator=gen)
    pattern_b = torch.randint(3, vocab, (2,), generator=gen)
    return [
        pattern_a.repeat(4)[:11],
        torch.randint(3, vocab, (9,), generator=gen),
        pattern_b.repeat(5)[:10],
    ]


def batches(vocab: int, prompt: int = 2) -> dict[str, dict[str, torch.Tensor]]:
    """The same documents packed (two rows: two documents, then one) and padded (one per row), each with
    its first ``prompt`` tokens unsupervised and a one-token hole in the first document's answer (a
    multi-turn loss mask), so every statistic meets a gap."""
    docs = documents(vocab)
    rows = {
        "packed": stack_rows([packed_row(docs[:2], 22), packed_row(docs[2:], 22)]),
        "padded": padded_rows(docs, 12),
    }
    for name, batch in rows.items():
        starts = [0, len(docs[0]), 0] if name == "packed" else [0, 0, 0]
        row_of = [0, 0, 1] if name == "packed" else [0, 1, 2]
        for doc, (row, start) in enumerate(zip(row_of, starts, strict=True)):
            batch["loss_mask"][row, start : start + prompt] = 0
            if doc == 0:
                batch["loss_mask"][row, start + 6] = 0
    return rows


def packed_batch(batch: Mapping[str, torch.Tensor], vocab: int) -> PackedBatch:
    return validate_batch(dict(batch), vocab_size=vocab)


def warm_up(
    module: torch.nn.Module, loss: Callable[[], torch.Tensor], steps: int = 8, lr: float = 2e-2
) -> None:
    """A few Adam steps on the project's objective, so the draft's predictions are partly right."""
    params = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=lr)
    for _ in range(steps):
        optimizer.zero_grad()
        loss().backward()
        optimizer.step()
    optimizer.zero_grad()


def assert_loss_equal(ours: torch.Tensor, theirs: torch.Tensor, what: str = "loss") -> None:
    ours, theirs = float(ours.detach()), float(theirs.detach())
    assert abs(ours - theirs) <= LOSS_ATOL + LOSS_RTOL * abs(theirs), (
        f"{what}: ours {ours!r}, NeMo's {theirs!r}"
    )


def assert_gradients_equal(
    draft: torch.nn.Module, reference: torch.nn.Module, renames: Sequence[tuple[str, str]]
) -> None:
    """Every trainable draft tensor's gradient equals NeMo's within :data:`GRAD_RTOL` of its norm, floored at
    :data:`GRAD_FLOOR` of the whole gradient's (and some gradient is non-zero: a loss that reached no weight
    would pass trivially)."""
    pairs = gradient_pairs(draft, reference, renames)
    assert pairs, "the draft has no trainable tensor"
    whole = sum(float(theirs.norm()) ** 2 for _, theirs in pairs.values()) ** 0.5
    worst = {}
    for name, (ours, theirs) in pairs.items():
        scale = max(float(theirs.norm()), GRAD_FLOOR * whole)
        worst[name] = float((ours - theirs).norm()) / max(scale, 1e-12)
        assert float((ours - theirs).norm()) <= GRAD_RTOL * scale + 1e-9, (
            f"{name}: gradient differs from NeMo's by {worst[name]:.2e} of its scale {scale:.3e} (its norm, at least {GRAD_FLOOR} of the whole gradient's {whole:.3e})"
        )
    assert any(float(theirs.norm()) > 0 for _, theirs in pairs.values()), "every gradient is zero"


def assert_counts_equal(ours: Mapping[str, torch.Tensor], theirs: Mapping[str, torch.Tensor]) -> None:
    """Named integer statistics equal on both sides (and not all zero, which a broken draft also gives)."""
    assert set(ours) == set(theirs)
    for name in ours:
        a = torch.as_tensor(ours[name]).double().flatten().tolist()
        b = torch.as_tensor(theirs[name]).double().flatten().tolist()
        assert a == b, f"{name}: ours {a}, NeMo's {b}"
