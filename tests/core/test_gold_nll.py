"""The written-out gold-token cross-entropy against ``F.cross_entropy`` and ``argmax``."""

from __future__ import annotations

import pytest
import torch

from lightning_drafts.core.gold_nll import nll_and_argmax


@pytest.mark.parametrize("single_backward", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nll_argmax_and_gradient_equal_cross_entropy(dtype, single_backward):
    gen = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(3, 5, 50, generator=gen)).to(dtype)
    logits[0, 1, 7] = logits[0, 1, 30] = logits[0, 1].max() + 1  # a tied maximum: the first id wins
    labels = torch.randint(0, 50, (3, 5), generator=gen)
    weights = torch.rand(3, 5, generator=gen)
    results = []
    for terms in (
        lambda z: (
            torch.nn.functional.cross_entropy(
                z.float().flatten(0, 1), labels.flatten(), reduction="none"
            ).view(3, 5),
            z.argmax(-1),
        ),
        lambda z: nll_and_argmax(z, labels, single_backward),
    ):
        z = logits.clone().requires_grad_(True)
        nll, predicted = terms(z)
        (nll * weights).sum().backward()
        results.append((nll.detach(), predicted, z.grad))
    (nll, predicted, grad), (fast_nll, fast_predicted, fast_grad) = results
    torch.testing.assert_close(fast_nll, nll, rtol=1e-6, atol=1e-6)
    assert torch.equal(fast_predicted, predicted) and int(fast_predicted[0, 1]) == 7
    assert fast_grad.dtype == dtype
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(fast_grad.float(), grad.float(), rtol=tolerance, atol=tolerance)


def test_a_second_backward_is_refused_only_when_the_softmax_is_reused():
    logits = torch.randn(4, 9, requires_grad=True)
    labels = torch.tensor([0, 3, 8, 1])
    shared, _ = nll_and_argmax(logits, labels)
    shared.sum().backward(retain_graph=True)
    first = logits.grad.clone()
    shared.sum().backward()
    torch.testing.assert_close(logits.grad, 2 * first)
    reused, _ = nll_and_argmax(logits, labels, single_backward=True)
    reused.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        reused.sum().backward()
