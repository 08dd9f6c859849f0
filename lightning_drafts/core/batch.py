"""The batch contract: validate a (packed or padded) batch and derive its packing metadata.

A padded batch is a packed batch with one document per row, so every module runs one code path.
All derivations are tensor ops over ``[B, T]`` / ``[B, D]``; nothing loops over tokens or documents.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_drafts.core.target_features import TargetFeatures, read_target_features

TOKEN_KEYS = ("input_ids", "attention_mask", "loss_mask", "position_ids", "doc_remaining")
INTEGER_KEYS = ("input_ids", "position_ids", "seq_lens", "doc_remaining")
FLAG_KEYS = ("attention_mask", "loss_mask")


@dataclass(frozen=True)
class PackedBatch:
    """A validated batch with every contract key present plus the derived document layout.

    ``doc_ids[b, t]`` is the index of t's document inside row b (pad slots belong to the row's last
    document); ``doc_start[b, t]`` is the row position where that document starts.
    """

    input_ids: Tensor
    attention_mask: Tensor
    loss_mask: Tensor
    position_ids: Tensor
    seq_lens: Tensor
    doc_remaining: Tensor
    doc_ids: Tensor
    doc_start: Tensor
    target_features: TargetFeatures | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)

    @property
    def real_tokens(self) -> int:
        return int(self.attention_mask.sum())

    def to_dict(self) -> dict[str, Tensor]:
        """The contract keys (and target features), e.g. to feed a batch through another module's validation."""
        out = {key: getattr(self, key) for key in (*TOKEN_KEYS, "seq_lens")}
        if self.target_features is not None:
            out.update(self.target_features.to_dict())
        return out


@dataclass(frozen=True)
class VarlenLayout:
    """The real tokens of a micro-batch flattened into one sequence for varlen kernels.

    ``token_index`` holds the flat ``b * T + t`` index of every real token, row-major; ``cu_seqlens``
    (int32) bounds each non-empty document inside that flattened sequence.
    """

    token_index: Tensor
    cu_seqlens: Tensor
    max_seqlen: int


def validate_batch(batch: Mapping[str, Tensor], vocab_size: int | None = None) -> PackedBatch:
    """Check ``batch`` against the contract and return it with every key present.

    Missing ``loss_mask`` defaults to ``attention_mask``; missing ``seq_lens`` / ``position_ids`` /
    ``doc_remaining`` are derived as one document per row. Every violation raises ``ValueError``
    naming the key and the offending value.

    The checks of the values run on the batch's device and are read back together, twice (before and
    after the document layout they guard): on CUDA each read waits for the device, so a valid batch costs
    two waits however many checks there are.
    """
    input_ids = _require_token_tensor(batch, "input_ids", shape=None)
    shape = tuple(input_ids.shape)
    checks = _Checks()
    attention_mask = _flag(
        batch, "attention_mask", shape, torch.ones_like(input_ids, dtype=torch.bool), checks
    )
    loss_mask = _flag(batch, "loss_mask", shape, attention_mask, checks)
    _check_right_padded(attention_mask, checks)
    _check_vocabulary(input_ids, vocab_size, checks)
    on_padding = loss_mask & ~attention_mask
    checks.add(on_padding, lambda: _on_padding_error(on_padding))

    seq_lens = batch.get("seq_lens")
    position_ids = batch.get("position_ids")
    if seq_lens is None:
        seq_lens = torch.full((shape[0], 1), shape[1], dtype=torch.long, device=input_ids.device)
    else:
        if position_ids is None:
            raise ValueError(
                "seq_lens was given without position_ids: packed documents need per-document "
                "position_ids that restart at 0 (a global arange would give every later document "
                "a wrong RoPE phase)"
            )
        seq_lens = _check_seq_lens(seq_lens, shape, checks)
    checks.read()
    doc_ids, doc_start = document_layout(seq_lens, shape[1])
    expected_positions = torch.arange(shape[1], device=input_ids.device) - doc_start
    if position_ids is None:
        position_ids = expected_positions
    else:
        position_ids = _require_token_tensor(batch, "position_ids", shape)
        _check_positions(position_ids, expected_positions, attention_mask, checks)

    remaining = doc_remaining(doc_ids, doc_start, attention_mask, seq_lens.shape[1])
    given_remaining = batch.get("doc_remaining")
    if given_remaining is not None:
        given_remaining = _require_token_tensor(batch, "doc_remaining", shape)
        mismatch = given_remaining != remaining
        checks.add(mismatch, lambda: _remaining_error(mismatch, given_remaining, remaining))
    checks.read()
    return PackedBatch(
        input_ids=input_ids.long(),
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        position_ids=position_ids.long(),
        seq_lens=seq_lens.long(),
        doc_remaining=remaining,
        doc_ids=doc_ids,
        doc_start=doc_start,
        target_features=read_target_features(batch, shape),
    )


class _Checks:
    """Violations found on the device, read back together: each is a bool tensor (any element set is a
    violation) and the function that raises its message (which may read the device again: it runs only for
    a batch that is wrong)."""

    def __init__(self) -> None:
        self._pending: list[tuple[Tensor, Callable[[], None]]] = []

    def add(self, bad: Tensor, report: Callable[[], None]) -> None:
        self._pending.append((bad.any(), report))

    def read(self) -> None:
        """Raise the first violation found, in the order the checks were added."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        found = torch.stack([bad for bad, _ in pending]).tolist()
        for flagged, (_, report) in zip(found, pending, strict=True):
            if flagged:
                report()


def _first(bad: Tensor) -> list[int]:
    return bad.nonzero()[0].tolist()


def _on_padding_error(on_padding: Tensor) -> None:
    b, t = _first(on_padding)
    raise ValueError(
        f"loss_mask is set on padding (first at row {b}, position {t}, where attention_mask is 0); "
        "supervise only real tokens"
    )


def _remaining_error(mismatch: Tensor, given: Tensor, remaining: Tensor) -> None:
    b, t = _first(mismatch)
    raise ValueError(
        f"doc_remaining[{b}, {t}] = {int(given[b, t])} but seq_lens and attention_mask "
        f"give {int(remaining[b, t])} real tokens after that position in its document"
    )


def document_layout(seq_lens: Tensor, width: int) -> tuple[Tensor, Tensor]:
    """Per-token document index and document start position for rows of ``width`` tokens.

    Zero-length entries of ``seq_lens`` repeat a boundary, so they never split a document.
    """
    ends = seq_lens.long().cumsum(dim=1)
    positions = torch.arange(width, device=seq_lens.device).expand(seq_lens.shape[0], width)
    doc_ids = torch.searchsorted(ends, positions.contiguous(), right=True)
    starts = ends - seq_lens.long()
    doc_start = starts.gather(1, doc_ids.clamp(max=seq_lens.shape[1] - 1))
    return doc_ids, doc_start


def doc_remaining(doc_ids: Tensor, doc_start: Tensor, attention_mask: Tensor, num_documents: int) -> Tensor:
    """Real tokens strictly after each position inside its own document (0 on padding); ``doc_ids`` index
    ``num_documents`` entries per row (``seq_lens``' width: sized by it, not by a read of the largest id)."""
    real_per_doc = torch.zeros(doc_ids.shape[0], num_documents, dtype=torch.long, device=doc_ids.device)
    real_per_doc.scatter_add_(1, doc_ids, attention_mask.long())
    last_real = doc_start + real_per_doc.gather(1, doc_ids) - 1
    positions = torch.arange(doc_ids.shape[1], device=doc_ids.device)
    return ((last_real - positions).clamp(min=0) * attention_mask).long()


def varlen_layout(packed: PackedBatch) -> VarlenLayout:
    """Flatten the real tokens of all rows into one sequence with one segment per document."""
    mask = packed.attention_mask.reshape(-1)
    token_index = mask.nonzero().squeeze(1)
    flat_docs = (
        packed.doc_ids + torch.arange(packed.shape[0], device=mask.device)[:, None] * packed.seq_lens.shape[1]
    )
    doc_of_token = flat_docs.reshape(-1)[token_index]
    lengths = torch.bincount(doc_of_token, minlength=packed.seq_lens.numel())
    lengths = lengths[lengths > 0]
    cu_seqlens = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=mask.device)
    cu_seqlens[1:] = lengths.cumsum(0)
    return VarlenLayout(token_index=token_index, cu_seqlens=cu_seqlens, max_seqlen=int(lengths.max()))


def _require_token_tensor(batch: Mapping[str, Tensor], key: str, shape: tuple[int, ...] | None) -> Tensor:
    value = batch.get(key)
    if not isinstance(value, Tensor):
        raise ValueError(f"batch[{key!r}] must be a tensor, got {type(value).__name__}")
    if value.dim() != 2:
        raise ValueError(f"batch[{key!r}] must be 2-D [B, T], got shape {tuple(value.shape)}")
    if shape is None and value.numel() == 0:
        raise ValueError(f"the batch is empty: batch['input_ids'] has shape {tuple(value.shape)}")
    if shape is not None and tuple(value.shape) != shape:
        raise ValueError(f"batch[{key!r}] has shape {tuple(value.shape)}, expected {shape} like input_ids")
    if key in INTEGER_KEYS and (value.dtype.is_floating_point or value.dtype == torch.bool):
        raise ValueError(f"batch[{key!r}] must hold integers, got dtype {value.dtype}")
    return value


def _flag(
    batch: Mapping[str, Tensor], key: str, shape: tuple[int, ...], default: Tensor, checks: _Checks
) -> Tensor:
    if batch.get(key) is None:
        return default
    value = _require_token_tensor(batch, key, shape)
    if value.dtype.is_floating_point:
        raise ValueError(f"batch[{key!r}] must be bool or integer 0/1, got dtype {value.dtype}")
    if value.dtype != torch.bool:
        bad = (value != 0) & (value != 1)

        def report() -> None:
            b, t = _first(bad)
            raise ValueError(f"batch[{key!r}][{b}, {t}] = {int(value[b, t])}; only 0 and 1 are allowed")

        checks.add(bad, report)
    return value.bool()


def _check_right_padded(attention_mask: Tensor, checks: _Checks) -> None:
    def empty() -> None:
        raise ValueError("the batch is empty: attention_mask has no real token")

    reopened = attention_mask[:, 1:] & ~attention_mask[:, :-1]

    def report() -> None:
        b, t = _first(reopened)
        raise ValueError(
            f"attention_mask row {b} has a real token at position {t + 1} after padding; padding must be "
            "trailing (pack documents back to back and pad only the end of the row)"
        )

    checks.add(~attention_mask.any(), empty)
    checks.add(reopened, report)


def _check_vocabulary(input_ids: Tensor, vocab_size: int | None, checks: _Checks) -> None:
    if vocab_size is None:
        return
    outside = (input_ids < 0) | (input_ids >= vocab_size)

    def report() -> None:
        b, t = _first(outside)
        raise ValueError(
            f"input_ids[{b}, {t}] = {int(input_ids[b, t])} is outside the target vocabulary [0, {vocab_size}); "
            "check that the tokenizer matches the target"
        )

    checks.add(outside, report)


def _check_seq_lens(seq_lens: Tensor, shape: tuple[int, ...], checks: _Checks) -> Tensor:
    if not isinstance(seq_lens, Tensor) or seq_lens.dim() != 2 or seq_lens.shape[0] != shape[0]:
        got = tuple(seq_lens.shape) if isinstance(seq_lens, Tensor) else type(seq_lens).__name__
        raise ValueError(f"batch['seq_lens'] must be [B, D] = [{shape[0]}, D], got {got}")
    if seq_lens.dtype.is_floating_point or seq_lens.dtype == torch.bool:
        raise ValueError(f"batch['seq_lens'] must hold integers, got dtype {seq_lens.dtype}")

    def negative() -> None:
        raise ValueError(f"batch['seq_lens'] has a negative length: {seq_lens.tolist()}")

    sums = seq_lens.sum(dim=1)
    wrong = sums != shape[1]

    def report() -> None:
        b = int(wrong.nonzero()[0])
        raise ValueError(
            f"batch['seq_lens'] row {b} = {seq_lens[b].tolist()} sums to {int(sums[b])}, not the row width "
            f"T = {shape[1]}; fold trailing padding into the row's last document"
        )

    checks.add(seq_lens < 0, negative)
    checks.add(wrong, report)
    return seq_lens


def _check_positions(position_ids: Tensor, expected: Tensor, attention_mask: Tensor, checks: _Checks) -> None:
    wrong = (position_ids != expected) & attention_mask

    def report() -> None:
        b, t = _first(wrong)
        raise ValueError(
            f"position_ids[{b}, {t}] = {int(position_ids[b, t])} but seq_lens puts that token at offset "
            f"{int(expected[b, t])} of its document; position_ids must restart at 0 where seq_lens starts "
            "a document (pass seq_lens for packed rows)"
        )

    checks.add(wrong, report)
