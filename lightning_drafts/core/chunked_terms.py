"""Per-block loss terms over chunks of blocks, so ``[blocks, slots, V]`` logits never exist whole.

Block drafts (DFlash, DFlash2, DSpark) project every block slot onto the full vocabulary. Each chunk
of blocks is run forward *and backward* during the forward pass: its gradients with respect to the
per-block inputs and the trainable parameters are stored, its logits freed, and the real backward
only scales the stored gradients by the incoming ones. Nothing is recomputed, so the cost is one
forward and one backward whatever the chunk size: a packed micro-batch, which holds more blocks
than a padded one, pays no more per block (activation checkpointing would recompute every chunk
but the last, which made packed DSpark slower than padded at the default chunk size).

This is exact because each differentiable output is a sum over blocks: its gradient is the sum of
the chunks' gradients. A family whose loss mixes several outputs with coefficients known up front
(DSpark's ``a_ce ce + a_tv tv + a_conf conf``) returns that mix as one output, so the expensive
vocabulary backward runs once; outputs normalised by sums only known after every chunk (DFlash2's
selector loss) are returned separately, each with its own stored gradients.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable
from torch.autograd.graph import get_gradient_edge

Terms = Callable[..., tuple[Tensor, ...]]


def over_chunks(
    terms: Terms,
    chunk_blocks: int | None,
    per_block: Sequence[Tensor],
    parameters: Iterable[Tensor] = (),
    differentiable: int = 1,
) -> list[Tensor]:
    """Run ``terms`` on chunks of ``chunk_blocks`` blocks (None = one piece, plain autograd) of the
    ``per_block`` tensors.

    ``terms`` returns its ``differentiable`` scalar outputs first (summed over chunks, with gradients
    to the floating ``per_block`` inputs and to ``parameters``, the trainable weights it uses), then
    outputs without gradients: scalars are summed over chunks, per-block tensors concatenated in block
    order. Pass every trainable parameter of the modules it calls (unused ones cost nothing): a
    trainable tensor ``terms`` reads but ``parameters`` lacks raises a ValueError when chunked.
    Trainable parameters' gradients are kept in fp32 (at least) from forward to backward.
    """
    per_block = tuple(per_block)
    blocks = per_block[0].shape[0]
    bounds = chunk_bounds(blocks, chunk_blocks or blocks)
    # Each tensor once: a parameter listed twice would receive its gradient twice.
    trainable = tuple({id(p): p for p in parameters if p.requires_grad}.values())
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (*per_block, *trainable))
    if chunk_blocks is None or not needs_grad:
        results = [terms(*(t[start:stop] for t in per_block)) for start, stop in _pairs(bounds)]
        return _combine(results)
    plan = _Plan(terms, bounds, len(per_block), differentiable)
    return list(_GradientInForward.apply(plan, *per_block, *trainable))


def chunk_bounds(blocks: int, size: int) -> list[int]:
    """``[0, ..., blocks]``: chunks of ``size`` blocks with the remainder (if any) first."""
    if blocks == 0:
        return [0]
    return [0, *range(blocks % size or size, blocks + 1, size)]


@dataclass(frozen=True)
class _Plan:
    terms: Terms
    bounds: list[int]
    num_per_block: int
    differentiable: int


class _GradientInForward(torch.autograd.Function):
    """Differentiable outputs whose gradients were computed chunk by chunk in ``forward``."""

    @staticmethod
    def forward(ctx, plan: _Plan, *inputs: Tensor) -> tuple[Tensor, ...]:
        per_block, parameters = inputs[: plan.num_per_block], inputs[plan.num_per_block :]
        wanted = [i for i, t in enumerate(inputs) if t.requires_grad]
        # Per differentiable output, one gradient buffer per input that wants one.
        grads = [[None] * len(inputs) for _ in range(plan.differentiable)]
        owned: list[set[int]] = [set() for _ in range(plan.differentiable)]
        results = []
        for start, stop in _pairs(plan.bounds):
            leaves = [t[start:stop].detach().requires_grad_(t.requires_grad) for t in per_block]
            # The chunk's own graph lives only until its gradients are taken below: keep it out of any
            # saved-tensor hooks around this call (activation offloading, memory accounting).
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
                outputs = plan.terms(*leaves)
            candidates = [*leaves, *parameters]
            sources = [candidates[i] for i in wanted]
            if start == 0:
                _check_no_unlisted_weights(outputs[: plan.differentiable], sources)
            live = [i for i, o in enumerate(outputs[: plan.differentiable]) if o.requires_grad]
            for index in live:
                # The last backward frees the chunk's graph (its logits) before the next chunk runs.
                chunk_grads = torch.autograd.grad(
                    outputs[index], sources, retain_graph=index != live[-1], allow_unused=True
                )
                for i, grad in zip(wanted, chunk_grads, strict=True):
                    _accumulate(
                        grads[index],
                        owned[index],
                        i,
                        grad,
                        inputs[i],
                        (start, stop) if i < len(per_block) else None,
                    )
                del chunk_grads
            results.append(tuple(o.detach() for o in outputs))
            del outputs, leaves, candidates, sources
        # Saved as what they are, the tensors kept for backward, so saved-tensor hooks see them.
        ctx.save_for_backward(*(grad for per_output in grads for grad in per_output))
        ctx.num_inputs, ctx.dtypes = len(inputs), [t.dtype for t in inputs]
        combined = _combine(results)
        ctx.mark_non_differentiable(*combined[plan.differentiable :])
        return tuple(combined)

    @staticmethod
    @once_differentiable
    def backward(ctx, *grad_outputs: Tensor) -> tuple[Tensor | None, ...]:
        saved, width = ctx.saved_tensors, ctx.num_inputs
        total: list[Tensor | None] = [None] * width
        for output, scale in enumerate(grad_outputs[: len(saved) // width]):
            for i, grad in enumerate(saved[output * width : (output + 1) * width]):
                if grad is not None:
                    # The scale stays fp32: rounding it to a bf16 gradient's dtype would skew the outputs' mix.
                    part = grad * scale.float()
                    total[i] = part if total[i] is None else total[i] + part
        return (
            None,
            *(None if g is None else g.to(dtype) for g, dtype in zip(total, ctx.dtypes, strict=True)),
        )


def _check_no_unlisted_weights(outputs: Sequence[Tensor], sources: Sequence[Tensor]) -> None:
    """A trainable tensor the terms read but were not given would get no gradient at all: refuse it.

    The walk stops at the given tensors' own gradient edges: a given weight may itself be a view of
    something else (FSDP1 with ``use_orig_params`` hands out views of its flat parameter).
    """
    given = {get_gradient_edge(t).node for t in sources}
    seen, stack = set(), [o.grad_fn for o in outputs if o.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen or node in given:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            raise ValueError(
                f"the chunked vocabulary terms read a trainable tensor of shape {tuple(variable.shape)} that "
                "was not passed in `parameters`; it would get no gradient. Add it to the parameters list"
            )
        stack.extend(next_node for next_node, _ in node.next_functions)


def _accumulate(
    buffers: list[Tensor | None],
    owned: set[int],
    index: int,
    grad: Tensor | None,
    source: Tensor,
    rows: tuple[int, int] | None,
) -> None:
    """Add one chunk's gradient: into its rows for a per-block input, into the whole for a parameter
    (summed in fp32 at least: a bf16 running sum over chunks would lose what one matmul keeps).

    A parameter's first gradient is kept as it is, never written to (a zero buffer and an add would
    sweep a vocabulary-sized table twice more per step); the first sum makes a buffer of its own
    (``owned``), which the later chunks add into in place.
    """
    if grad is None:
        return
    if rows is not None:
        if buffers[index] is None:
            buffers[index] = torch.zeros_like(source)
        buffers[index][rows[0] : rows[1]] = grad
        return
    current = buffers[index]
    if current is None:
        buffers[index] = grad.to(torch.promote_types(source.dtype, torch.float32))
    elif index in owned:
        current += grad
    else:
        buffers[index] = current + grad
        owned.add(index)


def _pack(tensor: Tensor) -> Tensor:
    # Detached, never the tensor itself: a node that saves its own output (log_softmax, exp) would
    # otherwise hold that output, whose grad_fn is the node, in a cycle through C++ that no garbage
    # collection sees. Any part of the chunk's graph its backward did not free (an output only a
    # retained or never-taken gradient reaches) then outlives the step with every tensor it saved.
    return tensor.detach()


def _unpack(tensor: Tensor) -> Tensor:
    return tensor


def _combine(results: list[tuple[Tensor, ...]]) -> list[Tensor]:
    return [
        torch.stack(parts).sum() if parts[0].dim() == 0 else torch.cat(parts)
        for parts in zip(*results, strict=True)
    ]


def _pairs(bounds: list[int]) -> list[tuple[int, int]]:
    return list(zip(bounds[:-1], bounds[1:], strict=True))
