"""Mask builders: the flex mask_mod materialises to the SDPA mask; kernel requests never fall back."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask
from torch.overrides import TorchFunctionMode

from lightning_drafts.attention import backends
from lightning_drafts.attention.backends import (
    attention_with_lse,
    block_causal_mask,
    dense_mask_from_mask_mod,
    document_causal_mask_mod,
    masked_attention,
    resolve_backend,
)
from lightning_drafts.core.batch import validate_batch
from tests.support.builders import packed_row, random_docs, stack_rows


def packed_example():
    a, b, c, d = random_docs([3, 2, 4, 5])
    return validate_batch(stack_rows([packed_row([a, b], 9), packed_row([c, d], 9)]))


def test_block_causal_mask_by_hand():
    mask = block_causal_mask(packed_example().doc_ids)[0, 0].int()
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0, 0, 0, 0],
            [0, 0, 0, 1, 0, 0, 0, 0, 0],
            [0, 0, 0, 1, 1, 0, 0, 0, 0],
            [0, 0, 0, 1, 1, 1, 0, 0, 0],  # pad slots are folded into the last document
            [0, 0, 0, 1, 1, 1, 1, 0, 0],
            [0, 0, 0, 1, 1, 1, 1, 1, 0],
            [0, 0, 0, 1, 1, 1, 1, 1, 1],
        ]
    )
    assert torch.equal(mask, expected)


def test_flex_mask_mod_materialises_to_the_sdpa_mask_including_pad_folding():
    packed = packed_example()
    batch, width = packed.shape
    flex = dense_mask_from_mask_mod(
        document_causal_mask_mod(packed.doc_ids), batch, width, width, torch.device("cpu")
    )
    assert torch.equal(flex, block_causal_mask(packed.doc_ids))


def test_attention_with_lse_matches_sdpa_and_never_returns_nan():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 9, 4, generator=gen) for _ in range(3))
    mask = block_causal_mask(packed_example().doc_ids)
    out, lse = attention_with_lse(q, k, v, mask, scale=0.5)
    reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.5)
    torch.testing.assert_close(out, reference)
    scores = (q @ k.transpose(-1, -2) * 0.5).masked_fill(~mask, float("-inf"))
    torch.testing.assert_close(lse, scores.logsumexp(-1))

    mask = mask.clone()
    mask[0, 0, 4] = False  # a query that sees nothing
    out, lse = attention_with_lse(q, k, v, mask, scale=0.5)
    assert torch.isfinite(out).all()
    assert torch.equal(out[0, :, 4], torch.zeros_like(out[0, :, 4]))
    assert torch.isneginf(lse[0, :, 4]).all()


class _RepeatCount(TorchFunctionMode):
    """Counts the calls that copy key/value heads out to the query heads."""

    def __init__(self) -> None:
        super().__init__()
        self.repeats = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("repeat_interleave", "repeat", "expand"):
            self.repeats += 1
        return func(*args, **(kwargs or {}))


def test_flex_takes_grouped_key_value_heads_without_repeating_them():
    """6 query heads over 2 key/value heads: flex (the GPU drafts' kernel, eager here) reads them grouped, and
    its output and log-sum-exp equal SDPA's over keys and values repeated out to the query heads."""
    gen = torch.Generator().manual_seed(0)
    doc_ids = packed_example().doc_ids
    batch, width = doc_ids.shape
    q = torch.randn(batch, 6, width, 16, generator=gen)
    k, v = (torch.randn(batch, 2, width, 16, generator=gen) for _ in range(2))
    block_mask = create_block_mask(document_causal_mask_mod(doc_ids), batch, None, width, width, device="cpu")
    dense = block_causal_mask(doc_ids)
    counter = _RepeatCount()
    with counter:
        out = masked_attention(q, k, v, block_mask, scale=0.25)
        out_lse, lse = attention_with_lse(q, k, v, block_mask, scale=0.25)
    assert counter.repeats == 0
    k6, v6 = k.repeat_interleave(3, dim=1), v.repeat_interleave(3, dim=1)
    reference = torch.nn.functional.scaled_dot_product_attention(q, k6, v6, attn_mask=dense, scale=0.25)
    torch.testing.assert_close(out, reference)
    torch.testing.assert_close(out_lse, reference)
    scores = (q @ k6.transpose(-1, -2) * 0.25).masked_fill(~dense, float("-inf"))
    torch.testing.assert_close(lse, scores.logsumexp(-1))


def test_auto_backend_is_sdpa_on_cpu():
    assert resolve_backend("auto", "cpu") == "sdpa"
    assert resolve_backend("flex", "cpu") == "flex"


@pytest.mark.parametrize(("requested", "match"), [("flash", "flash-attn"), ("xformers", "unknown")])
def test_unavailable_or_unknown_backend_raises(requested, match):
    with pytest.raises(ValueError, match=match):
        resolve_backend(requested, "cpu")


def test_auto_passes_over_a_flash_attn_that_does_not_load(tmp_path, monkeypatch):
    """An installed flash-attn built for another torch fails when its extension loads, not at ``find_spec``:
    ``auto`` must then say why and run flex on CUDA, and an explicit ``flash`` must be refused with that
    reason, instead of both failing at the first forward."""
    package = tmp_path / "flash_attn"
    package.mkdir()
    (package / "__init__.py").write_text(
        "raise ImportError('flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDevice')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    backends.flash_attn_problem.cache_clear()
    try:
        with pytest.warns(UserWarning, match="undefined symbol"):
            assert backends.resolve_backend("auto", "cuda") == "flex"
        with pytest.raises(ValueError, match="does not load with torch"):
            backends.resolve_backend("flash", "cuda")
    finally:
        backends.flash_attn_problem.cache_clear()
