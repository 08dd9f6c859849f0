"""Shared cases of the block-draft tests: packed / padded twins of one set of documents, the map of
anchors between the two layouts, and the packed == padded comparison."""

from __future__ import annotations

import torch

from lightning_drafts.attention.anchors import anchors_from_positions, flatten_anchors
from lightning_drafts.core.batch import PackedBatch
from lightning_drafts.dflash import DFlashModule
from tests.support.builders import VOCAB, packed_row, padded_rows, random_docs, stack_rows

MASK_TOKEN = VOCAB - 1  # never drawn by `documents`, as a reserved id should be
BLOCK = 4
ROWS = [[9, 6, 3], [11, 7], [10, 8]]  # the 3-token document is shorter than a block


def documents(lengths: list[int], seed: int = 0) -> list[torch.Tensor]:
    return random_docs(lengths, vocab=MASK_TOKEN, seed=seed)


# The holed case: document lengths per packed row; the 3-token document is shorter than a block.
HOLED_ROWS = [[14, 3, 9], [12, 8]]
HOLED_WIDTH = 26
HOLES = (0, 1, 6, 9, 10, 11)  # document offsets: a 2-token prompt, a one-token hole, a 3-token hole
# Document-local anchors (document index in row-major order -> offsets). Offset 5 skips the hole at 6;
# offset 8 of document 3 has only unsupervised labels; the last anchor of documents 2, 3 and 4 ends its
# block on the document's last token.
HOLED_ANCHORS = {0: [2, 3, 5, 7, 8], 2: [2, 5], 3: [3, 8], 4: [2, 4]}


def supervise_holes(batch: dict, positions: torch.Tensor) -> dict:
    batch = dict(batch)
    batch["loss_mask"] = batch["loss_mask"] * (~torch.isin(positions, torch.tensor(HOLES))).long()
    return batch


def holed_case() -> tuple[dict, dict, torch.Tensor]:
    """(packed batch, padded twin, packed anchors) of :data:`HOLED_ROWS` under :data:`HOLES`, anchored at
    :data:`HOLED_ANCHORS`."""
    docs = documents([n for row in HOLED_ROWS for n in row], seed=3)
    packed_rows, start = [], 0
    for lengths in HOLED_ROWS:
        packed_rows.append(packed_row(docs[start : start + len(lengths)], HOLED_WIDTH))
        start += len(lengths)
    packed = stack_rows(packed_rows)
    packed = supervise_holes(packed, packed["position_ids"])
    padded = padded_rows(docs, max(len(d) for d in docs))
    padded = supervise_holes(
        padded, torch.arange(padded["input_ids"].shape[1]).expand_as(padded["input_ids"])
    )
    starts = [sum(row[:i]) for row in HOLED_ROWS for i in range(len(row))]
    row_of = [r for r, row in enumerate(HOLED_ROWS) for _ in row]
    per_row = [[] for _ in HOLED_ROWS]
    for doc, offsets in HOLED_ANCHORS.items():
        per_row[row_of[doc]] += [starts[doc] + offset for offset in offsets]
    width = max(len(a) for a in per_row)
    anchors = torch.tensor([a + [-1] * (width - len(a)) for a in per_row])
    return packed, padded, anchors


def with_prompts(batch: dict, prompt: int = 2, holes: tuple[int, ...] = ()) -> dict:
    """Unsupervise the first ``prompt`` tokens of every document (and the document offsets in ``holes``,
    a short user turn between two assistant turns), as chat data does."""
    batch = dict(batch)
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(batch["input_ids"].shape[1]).expand_as(batch["input_ids"])
    supervised = (positions >= prompt) & ~torch.isin(positions, torch.tensor(holes, dtype=torch.long))
    batch["loss_mask"] = batch["loss_mask"] * supervised.long()
    return batch


def twins(rows: list[list[int]], width: int, seed: int = 0) -> tuple[dict, dict]:
    """The same documents packed ``rows`` to a row (``width`` wide) and one per padded row."""
    docs = documents([n for row in rows for n in row], seed=seed)
    packed, start = [], 0
    for lengths in rows:
        packed.append(packed_row(docs[start : start + len(lengths)], width))
        start += len(lengths)
    padded = padded_rows(docs, max(len(d) for d in docs))
    return with_prompts(stack_rows(packed), holes=(6,)), with_prompts(padded, holes=(6,))


def to_padded(
    packed: PackedBatch, anchors: torch.Tensor, values: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Packed ``[B, N]`` anchors (and per-anchor ``values`` aligned with them) -> the same anchors in
    the one-document-per-row layout.

    Document g of the padded batch is the g-th document of the packed batch in row-major order, and a
    row position becomes the offset inside its document. Block order is preserved (row-major on both
    sides), so per-block values keep their block.
    """
    blocks = flatten_anchors(anchors)
    docs_per_row = (packed.seq_lens > 0).sum(1)
    first_doc = docs_per_row.cumsum(0) - docs_per_row
    doc = first_doc[blocks.rows] + packed.doc_ids[blocks.rows, blocks.positions]
    offset = blocks.positions - packed.doc_start[blocks.rows, blocks.positions]
    padded = anchors_from_positions(doc, offset, int(docs_per_row.sum()))
    if values is None:
        return padded, None
    target = flatten_anchors(padded)
    padded_values = torch.zeros_like(padded)
    padded_values[target.rows, target.slots] = values[blocks.rows, blocks.slots]
    return padded, padded_values


def perturb(module: torch.nn.Module, seed: int = 1, scale: float = 0.05) -> None:
    """Move every trainable draft weight off its initial value so identity-initialised parts get exercised
    (frozen copies of target weights stay equal to the target's)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.draft.parameters():
            if param.requires_grad:
                param.add_(scale * torch.randn(param.shape, generator=gen))


def run(module: DFlashModule, batch: dict, anchors: torch.Tensor, **kwargs):
    module.zero_grad()
    output = module.compute_loss(batch, anchors=anchors, **kwargs)
    output.loss.backward()
    grads = {name: p.grad.clone() for name, p in module.draft.named_parameters() if p.requires_grad}
    return output, grads


def assert_same_results(first, second):
    (out_a, grads_a), (out_b, grads_b) = first, second
    torch.testing.assert_close(out_a.loss, out_b.loss, rtol=1e-6, atol=1e-7)
    assert torch.equal(out_a.valid, out_b.valid) and torch.equal(out_a.correct, out_b.correct)
    assert int(out_a.valid_tokens) == int(out_b.valid_tokens)
    for name, grad in grads_b.items():
        # fp32 round-off only: within 1e-5 of each tensor's largest gradient.
        scale = max(grad.abs().max().item(), 1e-6)
        torch.testing.assert_close(grads_a[name], grad, rtol=1e-5, atol=1e-5 * scale, msg=name)
    assert out_a.metrics.keys() == out_b.metrics.keys()
    for name in out_a.metrics:
        torch.testing.assert_close(out_a.metrics[name], out_b.metrics[name], rtol=1e-5, atol=1e-6)
