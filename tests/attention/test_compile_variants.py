"""The compiled flex entry points stay well below dynamo's recompile limit through a one-family train +
validation cycle of every draft family, with packed shapes that change every micro-batch.

CUDA's compiled path is taken on the CPU here: mask creation and the drafts' flex calls go through
``torch.compile`` with dynamo's ``CompileCounter`` backend (dynamo's guards and cache limits do not depend on
the backend; the graphs then run eagerly). CPU flex has no backward, not even a forward on inputs that require
grad: the draft's weights are frozen, and training micro-batches run their forward under grad mode (the
grad-mode guards are those of CUDA training), validation ones under no_grad.
Past the limit a variant would run unfused flex, a dense score matrix: ``fail_on_recompile_limit_hit`` turns
that into a failure here.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from lightning_drafts import DFlash2Module, DFlashModule, DSparkModule, Eagle3Module, MLAEagle3Module
from lightning_drafts.attention import backends
from tests.support.block_draft_cases import BLOCK, MASK_TOKEN, twins
from tests.support.builders import TINY_TARGETS, packed_row, padded_rows, random_docs, stack_rows
from tests.support.eagle3_checks import frequencies

# Half of dynamo's recompile limit (8): the headroom a production run keeps for variants not seen here.
HEADROOM = 4


def eagle3(module_class, family):
    return module_class(
        TINY_TARGETS[family],
        ttt_length=3,
        draft_vocab_size=48,
        token_frequencies=frequencies(),
        target_attn_backend="flex",
        draft_attn_backend="flex",
    )


def block_draft(module_class, **options):
    return module_class(
        TINY_TARGETS["qwen3"],
        mask_token_id=MASK_TOKEN,
        num_draft_layers=2,
        block_size=BLOCK,
        num_anchors=3,
        target_attn_backend="flex",
        draft_attn_backend="flex",
        **options,
    )


FAMILIES = {
    "eagle3": lambda: eagle3(Eagle3Module, "llama"),
    "mla_eagle3": lambda: eagle3(MLAEagle3Module, "deepseek_v3"),
    "dflash": lambda: block_draft(DFlashModule),
    "dflash_window": lambda: block_draft(DFlashModule, sliding_window=6),
    "dflash2": lambda: block_draft(DFlash2Module, conv_group_size=4, selector_rank=8, selector_top_k=4),
    "dspark": lambda: block_draft(DSparkModule),
}


def eagle3_batches():
    """Packed rows of 1 and 2 documents' worth of widths, and padded rows of 1 to 4 documents."""
    layouts = [[9, 13, 10], [20, 7], [5, 6, 7, 8], [31], [12, 12]]
    for index, lengths in enumerate(layouts):
        docs = random_docs(lengths, seed=index)
        yield stack_rows([packed_row(docs, sum(lengths) + index)])
        yield padded_rows(docs, max(lengths) + 1)


def block_batches():
    layouts = [[[9, 6, 3], [11, 7]], [[14, 5], [8, 8]], [[20]], [[4, 5, 6], [7, 8], [9]], [[10, 10]]]
    for index, rows in enumerate(layouts):
        packed, padded = twins(rows, width=max(sum(r) for r in rows) + index, seed=index)
        yield packed
        yield padded


@pytest.fixture
def compiled_on_cpu(monkeypatch):
    monkeypatch.setattr(backends, "compiles_on", lambda device: True)
    monkeypatch.setattr(backends, "COMPILER", CompileCounter())
    backends.reset_compiled_entries()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        yield
    backends.reset_compiled_entries()


@pytest.mark.parametrize("family", FAMILIES)
def test_a_train_and_validation_cycle_stays_below_the_recompile_limit(family, compiled_on_cpu):
    torch.manual_seed(0)
    module = FAMILIES[family]().requires_grad_(False)
    batches = eagle3_batches() if "eagle3" in family else block_batches()
    for step, batch in enumerate(batches):
        # Two training micro-batches, then one validation one, as a fit with frequent validation runs.
        with torch.set_grad_enabled(step % 3 != 2):
            output = module.compute_loss(dict(batch))
        assert torch.isfinite(output.loss)
    variants = backends.compiled_variants()
    # The drafts' mask creation and flex calls all went through compiled entry points, one per mask kind.
    assert any(name.startswith("_create_block_mask") for name in variants), variants
    assert any(name.startswith("_flex") for name in variants), variants
    assert max(variants.values()) <= HEADROOM, variants


def test_mask_kinds_tell_apart_what_dynamo_guards():
    """Each mask_mod code, a wrapped mask's kind and a None in the closure make a kind of their own; the
    tensors a mask reads do not."""
    doc_a, doc_b = torch.zeros(1, 8, dtype=torch.long), torch.ones(1, 12, dtype=torch.long)
    same_code = [backends.mask_kind(backends.document_causal_mask_mod(d)) for d in (doc_a, doc_b)]
    assert same_code[0] == same_code[1]

    def with_window(window):
        def mask_mod(b, h, q_idx, kv_idx):
            return kv_idx > q_idx - window if window is not None else kv_idx <= q_idx

        return mask_mod

    assert backends.mask_kind(with_window(4)) == backends.mask_kind(with_window(9))
    assert backends.mask_kind(with_window(4)) != backends.mask_kind(with_window(None))
    assert backends.mask_kind(with_window(4)) != same_code[0]
