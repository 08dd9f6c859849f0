"""Greedy speculative decoding from a :class:`~lightning_drafts.serving.family.Speculator`, verified by the
frozen target, and the target's own greedy decode it must equal.

The loop is family-agnostic and deliberately simple (batch of one, no KV cache: the target re-runs on the
whole sequence each round, fine for tiny and mid-size targets). One **round**:

1. the speculator proposes ``k <= num_steps`` tokens from the verified prefix and the target's captured
   features of that prefix (what serving engines hand a draft);
2. one target forward over ``prefix + proposal`` gives the target's greedy token at every proposed
   position and one past them;
3. the longest matching prefix of the proposal is accepted, then the target's own token at the first
   mismatch (or after a fully accepted proposal) is emitted as the correction / bonus token.

A tree round (:mod:`lightning_drafts.serving.draft_tree`, SGLang's top-k trees) proposes a token tree
instead; one target pass under the tree's ancestor mask checks every node, and the accepted tokens are the
longest root-to-node path of matches (sampled: :func:`~lightning_drafts.serving.sampling.verify_sampled`).
A chain is the tree whose every node has one child: both kinds of round share this loop, the verify pass
and the acceptance rules.

So every emitted token is the target's greedy token: the output equals the target's own greedy decode
(lossless), whatever the draft does. A round's acceptance length is ``accepted + 1``; the mean over rounds
is the figure engines report.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lightning_drafts.core.batch import validate_batch
from lightning_drafts.serving.draft_tree import DraftTree, TreeShape, TreeSpeculator
from lightning_drafts.serving.family import Speculator, VerifiedPrefix
from lightning_drafts.serving.sampling import Sampling, draw, verify_sampled
from lightning_drafts.training.target import FrozenTarget, TargetOutput


@dataclass(frozen=True)
class Generation:
    """One prompt's greedy continuation and, for speculative decoding, what each round accepted.

        ``accepted[r]`` counts the draft tokens round ``r`` accepted (before cutting the output at
        ``max_new_tokens`` or a stop token); ``proposed[r]`` is the length of that round's proposal (of a tree:
    its nodes, the draft tokens the target verified).
    """

    tokens: list[int]
    accepted: list[int] = field(default_factory=list)
    proposed: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class _TargetPass:
    greedy: Tensor
    hidden_states: tuple[Tensor, ...]
    last_hidden_state: Tensor


def _run_target(target: FrozenTarget, tokens: Tensor, layer_ids: Sequence[int]) -> _TargetPass:
    packed = validate_batch({"input_ids": tokens[None]}, vocab_size=target.vocab_size)
    return _as_pass(target, target(packed, layer_ids))


def _verify_tree(
    target: FrozenTarget, tokens: Tensor, tree: DraftTree, layer_ids: Sequence[int]
) -> _TargetPass:
    """One target pass over the verified ``tokens`` and every node of ``tree`` after them. A chain is
    plain causal attention; a branching tree runs under its ancestor mask, node positions by depth."""
    sequence = torch.cat([tokens, tree.tokens])
    if tree.is_chain():
        return _run_target(target, sequence, layer_ids)
    context = tokens.numel()
    width = sequence.numel()
    allowed = torch.ones(width, width, dtype=torch.bool, device=tokens.device).tril()
    allowed[context:, context:] = tree.ancestor_mask()
    positions = torch.cat([torch.arange(context, device=tokens.device), context - 1 + tree.depths()])
    return _as_pass(target, target.forward_with_mask(sequence, positions, allowed, layer_ids))


def _as_pass(target: FrozenTarget, output: TargetOutput) -> _TargetPass:
    last = output.last_hidden_state
    return _TargetPass(target.greedy_tokens(last)[0], tuple(h[0] for h in output.hidden_states), last[0])


@torch.no_grad()
def greedy_generate(
    target: FrozenTarget,
    prompt: Tensor,
    max_new_tokens: int,
    stop_token_ids: Iterable[int] = (),
    sampling: Sampling | None = None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """The target's own greedy continuation of ``prompt`` (the reference a lossless decode must equal), or
    with ``sampling`` its sampled one (drawn with ``generator``)."""
    stop = set(stop_token_ids)
    tokens = as_prompt(prompt, target)
    generated: list[int] = []
    while len(generated) < max_new_tokens:
        run = _run_target(target, tokens, ())
        token = int(run.greedy[-1]) if sampling is None else _sample_last(target, run, sampling, generator)
        generated.append(token)
        tokens = torch.cat([tokens, tokens.new_tensor([token])])
        if token in stop:
            break
    return generated


@torch.no_grad()
def speculative_generate(
    target: FrozenTarget,
    speculator: Speculator,
    prompt: Tensor,
    max_new_tokens: int,
    stop_token_ids: Iterable[int] = (),
    sampling: Sampling | None = None,
    generator: torch.Generator | None = None,
    tree: TreeShape | None = None,
) -> Generation:
    """Greedy speculative decoding of ``prompt``: lossless by construction (see the module docstring).
    With ``sampling``, speculative sampling (:mod:`lightning_drafts.serving.sampling`): every emitted token
    is distributed as the target's own sampling would draw it. With ``tree``, the speculator drafts trees
    of that shape (:mod:`lightning_drafts.serving.draft_tree`), verified greedily or by the same sampling
    rule; ``proposed`` then counts the tree's nodes, the draft tokens the target verified."""
    if tree is not None and not isinstance(speculator, TreeSpeculator):
        raise ValueError(
            f"{type(speculator).__name__} drafts no trees (only EAGLE-3 does); drop the tree settings (topk)"
        )
    stop = set(stop_token_ids)
    layer_ids = tuple(speculator.target_layer_ids)
    tokens = as_prompt(prompt, target)
    prefill = _run_target(target, tokens, layer_ids)
    first = (
        int(prefill.greedy[-1]) if sampling is None else _sample_last(target, prefill, sampling, generator)
    )
    generated, accepted, proposed = [first], [], []
    features, last_hidden = prefill.hidden_states, prefill.last_hidden_state
    tokens = torch.cat([tokens, tokens.new_tensor([first])])
    while len(generated) < max_new_tokens and not stop.intersection(generated):
        prefix = VerifiedPrefix(tokens, features, last_hidden, target)
        if tree is None:
            draft = DraftTree.chain(
                _checked_proposal(speculator, speculator.propose(prefix), target.vocab_size, tokens.device)
            )
        else:
            draft = _checked_tree(speculator, speculator.propose_tree(prefix, tree), tree, target.vocab_size)
        verified = _verify_tree(target, tokens, draft, layer_ids)
        context = tokens.numel()
        if sampling is None:
            # verified.greedy[L - 1] checks the root's children, verified.greedy[L + i] node i's.
            path = draft.accepted_path(int(verified.greedy[context - 1]), verified.greedy[context:])
            last = verified.greedy[context - 1 if not path else context + path[-1]]
            emitted = torch.cat([draft.tokens[path], last[None]])
        else:
            probs = sampling.probabilities(target.logits(verified.last_hidden_state[context - 1 :]))
            path, chosen = verify_sampled(probs, draft, generator)
            emitted = tokens.new_tensor(chosen)
        accepted.append(len(path))
        proposed.append(int(draft.tokens.numel()))
        generated.extend(int(t) for t in emitted)
        tokens = torch.cat([tokens, emitted])
        # Each node attended to the context and its ancestors only: the accepted path's features from this
        # pass are those a causal pass over the new prefix gives.
        keep = torch.cat([torch.arange(context, device=tokens.device), context + tokens.new_tensor(path)])
        features = tuple(h.index_select(0, keep) for h in verified.hidden_states)
        last_hidden = verified.last_hidden_state.index_select(0, keep)
    return Generation(_cut(generated, max_new_tokens, stop), accepted, proposed)


def _sample_last(
    target: FrozenTarget, run: _TargetPass, sampling: Sampling, generator: torch.Generator | None
) -> int:
    return draw(sampling.probabilities(target.logits(run.last_hidden_state[-1:]))[0], generator)


def as_prompt(prompt: Tensor | Sequence[int], target: FrozenTarget) -> Tensor:
    device = target.lm_head.weight.device
    tokens = torch.as_tensor(prompt, dtype=torch.long, device=device).reshape(-1)
    if tokens.numel() == 0:
        raise ValueError("a prompt is empty; speculative decoding needs at least one prompt token")
    return tokens


def _checked_proposal(speculator: Speculator, proposal: Any, vocab_size: int, device: torch.device) -> Tensor:
    name = type(speculator).__name__
    if not isinstance(proposal, Tensor) or proposal.dim() != 1 or proposal.dtype != torch.long:
        got = tuple(proposal.shape) if isinstance(proposal, Tensor) else type(proposal).__name__
        raise ValueError(f"{name}.propose must return a 1-D long tensor of target ids, got {got}")
    if proposal.numel() > speculator.num_steps:
        raise ValueError(
            f"{name}.propose returned {proposal.numel()} tokens, more than num_steps={speculator.num_steps}"
        )
    if proposal.numel() and (int(proposal.min()) < 0 or int(proposal.max()) >= vocab_size):
        raise ValueError(
            f"{name}.propose returned ids outside the target vocabulary [0, {vocab_size}): {proposal.tolist()}; "
            "map draft ids to target ids (target = draft + d2t[draft]) before returning"
        )
    return proposal.to(device)


def _checked_tree(speculator: Any, tree: Any, shape: TreeShape, vocab_size: int) -> DraftTree:
    name = type(speculator).__name__
    if not isinstance(tree, DraftTree) or tree.tokens.shape != tree.parents.shape or tree.tokens.dim() != 1:
        raise ValueError(
            f"{name}.propose_tree must return a DraftTree of 1-D tokens and parents, got {tree!r}"
        )
    count = tree.tokens.numel()
    if not 0 < count < shape.num_draft_tokens:
        raise ValueError(
            f"{name}.propose_tree returned {count} nodes; {shape.label()} allows 1..{shape.num_draft_tokens - 1}"
        )
    if (
        bool((tree.parents >= torch.arange(count, device=tree.parents.device)).any())
        or int(tree.parents.min()) < -1
    ):
        raise ValueError(
            f"{name}.propose_tree returned parents {tree.parents.tolist()}; each must be -1 or an earlier node"
        )
    if int(tree.tokens.min()) < 0 or int(tree.tokens.max()) >= vocab_size:
        raise ValueError(
            f"{name}.propose_tree returned ids outside the target vocabulary [0, {vocab_size}): {tree.tokens.tolist()}"
        )
    return tree


def _cut(generated: list[int], max_new_tokens: int, stop: set[int]) -> list[int]:
    generated = generated[:max_new_tokens]
    for index, token in enumerate(generated):
        if token in stop:
            return generated[: index + 1]
    return generated
