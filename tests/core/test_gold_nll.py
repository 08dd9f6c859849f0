"""The written-out gold-token cross-entropy against ``F.cross_entropy`` and ``argmax``."""

from __future__ import annotations

import pytest
import torch

from lightning_drafts.core.gold_nll import nll_and_argmax


@pytest.mark.parametrize("consume", [False, True])
@pytest.mark.parametrize("single_backward", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nll_argmax_and_gradient_equal_cross_entropy(dtype, single_backward, consume):
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
        # Handed over (consume), the logits must be a flat tensor of their own: a non-leaf copy.
        lambda z: nll_and_argmax(z.flatten(0, 1) * 1 if consume else z, labels, single_backward, consume),
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


def test_consumed_logits_hold_the_softmax_and_no_second_copy_is_saved():
    """``consume=True`` writes the softmax into the logits handed over, and backward keeps that storage,
    not a second ``[n, V]`` tensor; without it the logits stay as they were. A reshaped view is refused."""
    logits, labels = torch.randn(6, 40), torch.randint(0, 40, (6,))
    saved: list[torch.Tensor] = []
    for consume in (False, True):
        z = logits.clone().requires_grad_(True)
        given = z * 1
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            nll, _ = nll_and_argmax(given, labels, consume=consume)
        vocabulary_wide = {t.data_ptr() for t in saved if tuple(t.shape) == (6, 40)}
        if consume:
            torch.testing.assert_close(given.detach(), torch.softmax(logits, -1), rtol=0, atol=0)
            assert vocabulary_wide == {given.data_ptr()}
        else:
            assert torch.equal(given.detach(), logits) and given.data_ptr() not in vocabulary_wide
        nll.sum().backward()
        expected = torch.softmax(logits, -1) - torch.nn.functional.one_hot(labels, 40)
        torch.testing.assert_close(z.grad, expected, rtol=1e-6, atol=1e-6)
    with pytest.raises(
        ValueError, match=r"consumed logits must be a flat \[n, V\] tensor, got shape \(2, 3, 40\)"
    ):
        nll_and_argmax(torch.randn(2, 3, 40) * 1, torch.zeros(2, 3, dtype=torch.long), consume=True)
