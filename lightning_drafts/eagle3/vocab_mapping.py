"""The EAGLE-3 draft vocabulary: which target ids the draft's LM head predicts
(docs/concepts/eagle3.md#draft-vocabulary).

Selection order (NeMo's): the special ids, then ids by descending supervised-token count (ties go to
the lower id), then the lowest unused ids when the data has fewer distinct tokens than the draft
vocabulary. Draft id ``i`` predicts target id ``selected[i]``; the list is **not** sorted, so the
teacher must be gathered with ``index_select(selected)`` (never with a boolean ``t2d`` gather, whose
ascending order would misalign the LM-head rows). Serving engines read only ``d2t``, the offset form
``target = draft + d2t[draft]``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from lightning_drafts.core.checks import check_int


@dataclass(frozen=True)
class VocabMapping:
    """A draft vocabulary and how well it covers the training data.

    Attributes:
        selected_token_ids: long ``[V_d]``; draft id ``i`` predicts target id ``selected_token_ids[i]``.
        target_vocab_size: ``V``.
        coverage: the share of counted (supervised) target tokens whose id is in the draft vocabulary.
        distinct_tokens: how many ids have a non-zero count.
        filled: draft ids given to never-seen ids because the data had fewer distinct tokens than ``V_d``.
    """

    selected_token_ids: Tensor
    target_vocab_size: int
    coverage: float
    distinct_tokens: int
    filled: int

    @property
    def draft_vocab_size(self) -> int:
        return int(self.selected_token_ids.numel())

    @property
    def d2t(self) -> Tensor:
        """Offsets, long ``[V_d]``: ``target = draft + d2t[draft]`` (may be negative)."""
        return self.selected_token_ids - torch.arange(
            self.draft_vocab_size, device=self.selected_token_ids.device
        )

    @property
    def t2d(self) -> Tensor:
        """Bool ``[V]``: True at every target id the draft can predict."""
        mask = torch.zeros(self.target_vocab_size, dtype=torch.bool, device=self.selected_token_ids.device)
        mask[self.selected_token_ids] = True
        return mask

    def summary(self) -> str:
        text = (
            f"draft vocabulary: {self.draft_vocab_size} of {self.target_vocab_size} target ids, covering "
            f"{self.coverage:.2%} of the supervised tokens ({self.distinct_tokens} distinct ids seen)"
        )
        if self.filled:
            text += (
                f"; {self.filled} draft ids hold never-seen ids (fewer distinct tokens than draft_vocab_size)"
            )
        return text


def count_supervised_tokens(batches: Iterable[Mapping[str, Tensor]], vocab_size: int) -> Tensor:
    """Dense long ``[V]`` counts of ``input_ids[loss_mask]`` over ``batches`` (ids outside ``[0, V)`` dropped).

    The tokens counted are the supervised (assistant) tokens in the dataset frame, as in NeMo's scan.
    A batch without ``loss_mask`` counts its real tokens (``attention_mask``), or every token.
    """
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for batch in batches:
        ids = batch["input_ids"]
        mask = batch.get("loss_mask", batch.get("attention_mask"))
        tokens = ids[mask.bool()] if mask is not None else ids.reshape(-1)
        tokens = tokens[(tokens >= 0) & (tokens < vocab_size)].long().cpu()
        counts += torch.bincount(tokens, minlength=vocab_size)
    return counts


def load_token_counts(source: Tensor | Sequence[int] | str | Path, vocab_size: int) -> Tensor:
    """Token counts from a tensor, a list, or a ``torch.save``-d tensor file, checked against ``V``."""
    if isinstance(source, (str, Path)):
        source = torch.load(source, map_location="cpu", weights_only=True)
    counts = torch.as_tensor(source)
    if counts.dim() != 1 or counts.numel() != vocab_size:
        raise ValueError(
            f"token_frequencies must be a 1-D count per target id, length {vocab_size}; got shape "
            f"{tuple(counts.shape)} (count with count_supervised_tokens(loader, vocab_size))"
        )
    if counts.dtype.is_floating_point or counts.dtype == torch.bool:
        raise ValueError(f"token_frequencies must hold integer counts, got dtype {counts.dtype}")
    if (counts < 0).any():
        raise ValueError(f"token_frequencies has a negative count at id {int((counts < 0).nonzero()[0])}")
    return counts.long().cpu()


def build_vocab_mapping(
    counts: Tensor, draft_vocab_size: int | None, special_token_ids: Iterable[int | Sequence[int] | None] = ()
) -> VocabMapping:
    """Choose the draft vocabulary from per-id ``counts`` (long ``[V]``).

    ``draft_vocab_size`` ``None`` or ``V`` gives the identity mapping. Raises ``ValueError`` for a
    non-positive size, one above ``V``, or counts that hold no token at all.
    """
    vocab_size = int(counts.numel())
    counts = counts.long().cpu()
    total = int(counts.sum())
    if total <= 0:
        raise ValueError(
            "the token counts are all zero: no supervised token was seen, so there is nothing to choose a "
            "draft vocabulary from (check loss_mask in the training data)"
        )
    size = check_draft_vocab_size(draft_vocab_size, vocab_size)
    if size == vocab_size:
        # No compression: keep draft id == target id (what serving assumes without d2t).
        return VocabMapping(torch.arange(vocab_size), vocab_size, 1.0, int((counts > 0).sum()), 0)
    taken = torch.zeros(vocab_size, dtype=torch.bool)
    chosen: list[Tensor] = []

    def take(ids: Tensor) -> None:
        room = size - sum(int(c.numel()) for c in chosen)
        ids = ids[~taken[ids]][:room]
        taken[ids] = True
        chosen.append(ids)

    take(_special_ids(special_token_ids, vocab_size))
    order = torch.sort(counts, descending=True, stable=True).indices
    take(order[counts[order] > 0])
    seen = sum(int(c.numel()) for c in chosen)
    take(torch.arange(vocab_size))
    selected = torch.cat(chosen)
    return VocabMapping(
        selected_token_ids=selected,
        target_vocab_size=vocab_size,
        coverage=float(counts[selected].sum()) / total,
        distinct_tokens=int((counts > 0).sum()),
        filled=size - seen,
    )


def check_draft_vocab_size(draft_vocab_size: int | None, vocab_size: int) -> int:
    """The effective draft vocabulary size: ``V`` for ``None``; a size above ``V`` is refused (the draft
    cannot hold ids its target does not have, and taking it as ``V`` would hide a config written for
    another target)."""
    if draft_vocab_size is None:
        return vocab_size
    check_int("draft_vocab_size", draft_vocab_size, 1, hint="or None: the full target vocabulary")
    if draft_vocab_size > vocab_size:
        raise ValueError(
            f"draft_vocab_size = {draft_vocab_size} is larger than the target's vocabulary of {vocab_size} ids; "
            f"write at most {vocab_size} (or null: the full vocabulary)"
        )
    return draft_vocab_size


def _special_ids(ids: Iterable[int | Sequence[int] | None], vocab_size: int) -> Tensor:
    flat: list[int] = []
    for value in ids:
        values = value if isinstance(value, (list, tuple)) else [value]
        flat += [int(v) for v in values if v is not None and 0 <= int(v) < vocab_size and int(v) not in flat]
    return torch.tensor(flat, dtype=torch.long)
