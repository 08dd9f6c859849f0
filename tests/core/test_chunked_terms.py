"""Chunked vocabulary terms (gradients taken in forward) equal the one-piece computation under plain
autograd, in every value and every gradient, and never run a chunk twice."""

from __future__ import annotations

import pytest
import torch

from lightning_drafts.core.chunked_terms import chunk_bounds, over_chunks
from tests.support.builders import assert_no_tensor_outlives


@pytest.mark.parametrize(("blocks", "size"), [(7, 3), (6, 3), (5, 1), (4, 9), (1, 2)])
def test_chunks_cover_every_block_once_with_the_remainder_first(blocks: int, size: int):
    bounds = chunk_bounds(blocks, size)
    sizes = [stop - start for start, stop in zip(bounds[:-1], bounds[1:], strict=True)]
    assert bounds[0] == 0 and bounds[-1] == blocks and sum(sizes) == blocks
    assert all(s == size for s in sizes[1:]) and 0 < sizes[0] <= size


class Terms(torch.nn.Module):
    """Two differentiable sums (one through a trainable head and an expanded per-block weight, one through
    a second parameter), a summed scalar without gradient and a per-block argmax; counts its calls."""

    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()
        self.head = torch.nn.Parameter(torch.randn(6, 11, generator=generator))
        self.scale = torch.nn.Parameter(torch.randn(11, generator=generator))
        self.frozen = torch.nn.Parameter(torch.randn(11, generator=generator), requires_grad=False)
        self.calls = 0

    def forward(self, features: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor):
        self.calls += 1
        logits = features @ (self.head + weight) + self.frozen
        picked = logits.gather(-1, labels[..., None]).squeeze(-1)
        return (
            torch.logsumexp(logits, -1).sum() - picked.sum(),
            (torch.tanh(logits) * self.scale).square().sum(),
            (logits > 0).sum().float(),
            logits.argmax(-1),
        )


def run(size: int | None, differentiable: int, coefficients: tuple[float, float] = (1.0, -0.5)):
    generator = torch.Generator().manual_seed(0)
    terms = Terms(generator)
    features = torch.randn(7, 4, 6, generator=generator).requires_grad_()
    weight = torch.randn(6, 11, generator=generator).requires_grad_()
    labels = torch.randint(0, 11, (7, 4), generator=generator)
    per_block = (features, weight.expand(7, 6, 11), labels)
    if differentiable == 1:

        def mixed(*chunk):
            first, second, *rest = terms(*chunk)
            return (coefficients[0] * first + coefficients[1] * second, *rest)

        total, count, argmax = over_chunks(mixed, size, per_block, terms.parameters(), differentiable=1)
    else:
        first, second, count, argmax = over_chunks(
            terms, size, per_block, terms.parameters(), differentiable=2
        )
        # The coefficient of one output only known after every chunk (as DFlash2's selector weight).
        total = coefficients[0] * first + coefficients[1] * second / count
    total.backward()
    grads = (features.grad, weight.grad, terms.head.grad, terms.scale.grad)
    return (total.detach(), count, argmax, *grads), terms.calls


@pytest.mark.parametrize("differentiable", [1, 2])
@pytest.mark.parametrize("size", [1, 2, 3, 5, 8])
def test_chunked_terms_equal_one_piece_in_value_and_every_gradient(size: int, differentiable: int):
    reference, _ = run(None, differentiable)
    chunked, calls = run(size, differentiable)
    torch.testing.assert_close(chunked[0], reference[0])
    assert torch.equal(chunked[1], reference[1]) and torch.equal(chunked[2], reference[2])
    for got, want in zip(chunked[3:], reference[3:], strict=True):
        torch.testing.assert_close(got, want)
    assert calls == len(chunk_bounds(7, size)) - 1  # one forward per chunk: nothing recomputed in backward


def test_without_gradients_chunks_only_run_forward():
    generator = torch.Generator().manual_seed(0)
    terms = Terms(generator)
    features, labels = torch.randn(5, 4, 6, generator=generator), torch.randint(0, 11, (5, 4))
    with torch.no_grad():
        first, second, count, argmax = over_chunks(
            terms, 2, (features, torch.zeros(5, 6, 11), labels), terms.parameters(), differentiable=2
        )
    assert not first.requires_grad and argmax.shape == (5, 4) and terms.calls == 3


def test_a_trainable_weight_missing_from_parameters_is_refused():
    generator = torch.Generator().manual_seed(0)
    terms = Terms(generator)
    features, labels = torch.randn(5, 4, 6, requires_grad=True), torch.randint(0, 11, (5, 4))
    with pytest.raises(ValueError, match=r"trainable tensor of shape \(11,\) .* not passed in `parameters`"):
        over_chunks(terms, 2, (features, torch.zeros(5, 6, 11), labels), [terms.head], differentiable=2)


def test_saved_tensor_hooks_see_the_stored_gradients_not_the_chunks_logits():
    generator = torch.Generator().manual_seed(0)
    terms = Terms(generator)
    features = torch.randn(6, 4, 6, generator=generator, requires_grad=True)
    labels = torch.randint(0, 11, (6, 4), generator=generator)
    shapes = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        outputs = over_chunks(terms, 2, (features, torch.zeros(6, 6, 11), labels), terms.parameters(), 2)
    assert (6, 4, 6) in shapes and (6, 11) in shapes  # the gradients kept for the features and the head
    assert not [shape for shape in shapes if shape[-1:] == (11,) and len(shape) == 3]  # no chunk logits
    (outputs[0] + outputs[1]).backward()
    assert features.grad is not None and terms.head.grad is not None


@pytest.mark.parametrize("differentiable", [1, 2])
def test_no_tensor_of_a_chunk_outlives_the_call(differentiable: int):
    """A chunk's graph goes with the call, also its nodes that save their own output (logsumexp, exp)
    where the chunk's gradients do not free them: an output differentiated with the graph retained
    (another one follows), or a value no gradient is taken of (DFlash's gold-token probability)."""
    generator = torch.Generator().manual_seed(0)
    terms = Terms(generator)
    features = torch.randn(7, 4, 6, generator=generator, requires_grad=True)
    labels = torch.randint(0, 11, (7, 4), generator=generator)
    per_block = (features, torch.zeros(7, 6, 11), labels)

    def with_an_undifferentiated_value(*chunk: torch.Tensor) -> tuple[torch.Tensor, ...]:
        first, second, *rest = terms(*chunk)
        sums = (first + second,) if differentiable == 1 else (first, second)
        return (*sums, torch.exp(-first).detach(), *rest)

    def step() -> None:
        outputs = over_chunks(
            with_an_undifferentiated_value, 2, per_block, terms.parameters(), differentiable
        )
        torch.stack(outputs[:differentiable]).sum().backward()
        features.grad = None
        terms.zero_grad(set_to_none=True)

    assert_no_tensor_outlives(step)


def test_bf16_gradients_keep_their_dtype_and_match_fp32():
    def grads(dtype: torch.dtype, size: int | None) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(0)
        terms = Terms(generator).to(dtype)
        features = torch.randn(8, 4, 6, generator=generator).to(dtype).requires_grad_()
        labels = torch.randint(0, 11, (8, 4), generator=generator)
        per_block = (features, torch.zeros(8, 6, 11, dtype=dtype), labels)
        first, second, *_ = over_chunks(terms, size, per_block, terms.parameters(), differentiable=2)
        (first - 0.5 * second).backward()
        return [features.grad, terms.head.grad, terms.scale.grad]

    for got, want in zip(grads(torch.bfloat16, 2), grads(torch.float32, None), strict=True):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.05 * want.abs().max().item())


def test_weights_that_are_views_count_as_given_and_a_weight_given_twice_counts_once():
    """FSDP1 (use_orig_params) hands modules views of one flat parameter: such a view is a given weight,
    not an unlisted one, and gets the one-piece gradient; listing a weight twice does not double it."""
    generator = torch.Generator().manual_seed(0)
    flat = torch.randn(66, generator=generator, requires_grad=True)
    features = torch.randn(5, 4, 6, generator=generator)

    def run(size: int | None) -> torch.Tensor:
        flat.grad = None
        head = flat.view(6, 11)

        def terms(chunk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            logits = chunk @ head
            return torch.logsumexp(logits, -1).sum(), logits.argmax(-1)

        total, _ = over_chunks(terms, size, (features,), [head, head])
        total.backward()
        return flat.grad.clone()

    torch.testing.assert_close(run(2), run(None))
