"""The compiled flex entry points (CUDA's path) compiled and run on CPU through inductor (CPU flex has a
compiled forward): the drafts' entry points keep caches apart from transformers' compiled
``flex_attention`` (the target's layers) and from each other, so no variant of one pushes another past
dynamo's recompile limit into the unfused fallback; the compiled block mask equals the eager one."""

from __future__ import annotations

import warnings

import torch
from torch.nn.attention.flex_attention import create_block_mask
from transformers.integrations.flex_attention import compile_friendly_flex_attention

from lightning_drafts.attention import backends
from lightning_drafts.attention.backends import compiled_flex_attention, document_causal_mask_mod


def qkv(heads: int, length: int, dim: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(1, heads, length, dim, generator=generator) for _ in range(3)]


def causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def test_the_draft_entry_point_never_shares_the_targets_compile_cache():
    """With room for one variant per function and a hard failure when it is exceeded, the target's call
    (transformers' compiled flex) and a draft call of another shape each compile once. Had the drafts
    compiled ``flex_attention`` itself, the draft call would be a recompile of the target's function and
    raise here. (CPU inductor compiles flex forward only, without the log-sum-exp: the drafts' entry with the
    log-sum-exp, a function of its own too, compiles in tools/gpu_paths.py on CUDA, where the
    compiled kernels' values are compared with SDPA's. Their values are not compared here: torch's CPU
    inductor flex kernel returns wrong values or NaN at some small row widths on AVX2 machines, a defect of
    that kernel, not of the caches this test is about.)"""
    backends.reset_compiled_entries()
    length = 128
    mask = create_block_mask(causal, 1, None, length, length, device="cpu")
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        q, k, v = qkv(4, length, 8, seed=0)
        target_out = compile_friendly_flex_attention(q, k, v, block_mask=mask, scale=0.5)
        q2, k2, v2 = qkv(2, length, 16, seed=1)
        draft_out = compiled_flex_attention()(q2, k2, v2, mask, 0.25)
    assert target_out.shape == q.shape and draft_out.shape == q2.shape
    assert backends.compiled_variants() == {"_flex_kind0": 1}


def test_the_compiled_block_mask_equals_the_eager_one_without_the_deprecated_flag():
    doc_ids = torch.tensor([[0] * 100 + [1] * 60 + [2] * 96])
    mask_mod = document_causal_mask_mod(doc_ids)
    eager = create_block_mask(mask_mod, 1, None, 256, 256, device="cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = backends.compiled_create_block_mask()(mask_mod, 1, 256, 256, torch.device("cpu"))
    assert not [w for w in caught if "_compile" in str(w.message)], [str(w.message) for w in caught]
    assert torch.equal(compiled.to_dense(), eager.to_dense())
    assert torch.equal(compiled.kv_num_blocks, eager.kv_num_blocks)
