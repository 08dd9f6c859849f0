"""The CPU flash kernel called directly: output and log-sum-exp, and the gradients through either or
both, against the softmax written out."""

from __future__ import annotations

import pytest
import torch

from lightning_drafts.attention.cpu_flash import cpu_flash_attention

SCALE = 0.3


def written_out(query, key, value, allowed):
    """fp32 softmax attention with key/value head ``h // groups`` per query head, and its log-sum-exp."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.float().repeat_interleave(groups, 1), value.float().repeat_interleave(groups, 1)
    scores = (query.float() @ key.transpose(-1, -2) * SCALE).masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse[..., None]) @ value, lse


@pytest.mark.parametrize("reads", ["output", "lse", "both"])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "value_dim", "causal"),
    [(4, 4, 8, 8, False), (4, 2, 8, 8, True), (4, 1, 8, 6, False)],
    ids=["heads", "grouped-causal", "one-kv-head-narrow-values"],
)
def test_output_lse_and_their_gradients_equal_the_written_out_softmax(
    heads, kv_heads, dim, value_dim, causal, reads
):
    gen = torch.Generator().manual_seed(heads + kv_heads + dim)
    batch, q_len, kv_len = 2, 9, 9
    query = torch.randn(batch, heads, q_len, dim, generator=gen)
    key = torch.randn(batch, kv_heads, kv_len, dim, generator=gen)
    value = torch.randn(batch, kv_heads, kv_len, value_dim, generator=gen)
    if causal:
        allowed, bias = torch.ones(q_len, kv_len, dtype=torch.bool).tril().expand(batch, 1, -1, -1), None
    else:
        allowed = torch.rand(batch, 1, q_len, kv_len, generator=gen) > 0.4
        allowed[..., 0] = True
        bias = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
    out_grad = torch.randn(batch, heads, q_len, value_dim, generator=gen)
    lse_grad = torch.randn(batch, heads, q_len, generator=gen)
    results = []
    for attend in (
        lambda q, k, v: cpu_flash_attention(q, k, v, SCALE, causal=causal, bias=bias),
        lambda q, k, v: written_out(q, k, v, allowed),
    ):
        inputs = [x.clone().requires_grad_(True) for x in (query, key, value)]
        out, lse = attend(*inputs)
        objective = {
            "output": (out * out_grad).sum(),
            "lse": (lse * lse_grad).sum(),
            "both": (out * out_grad).sum() + (lse * lse_grad).sum(),
        }[reads]
        # The log-sum-exp alone does not read the values: their gradient is zero (None for autograd).
        grads = torch.autograd.grad(objective, inputs, allow_unused=True)
        results.append(
            (out, lse, [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, grads, strict=True)])
        )
    (out, lse, grads), (ref_out, ref_lse, ref_grads) = results
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-6)
    for grad, ref_grad in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=2e-6)


def test_bf16_gradients_through_the_lse_follow_the_fp32_ones():
    gen = torch.Generator().manual_seed(1)
    query, key, value = (torch.randn(1, 4, 12, 16, generator=gen) for _ in range(3))
    lse_grad = torch.randn(1, 4, 12, generator=gen)
    grads = {}
    for dtype in (torch.float32, torch.bfloat16):
        inputs = [x.to(dtype).requires_grad_(True) for x in (query, key, value)]
        out, lse = cpu_flash_attention(*inputs, SCALE, causal=True)
        assert out.dtype == dtype and lse.dtype == torch.float32
        grads[dtype] = torch.autograd.grad((out.float().sum() + (lse * lse_grad).sum()), inputs)
    for low, full in zip(grads[torch.bfloat16], grads[torch.float32], strict=True):
        assert low.dtype == torch.bfloat16
        torch.testing.assert_close(low.float(), full, rtol=3e-2, atol=3e-2)
