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
from lightning_drafts.serving.family import Speculator, VerifiedPrefix
from lightning_drafts.serving.sampling import Sampling, draw, verify_sampled
from lightning_drafts.training.target import FrozenTarget


@dataclass(frozen=True)
class Generation:
    """One prompt's greedy continuation and, for speculative decoding, what each round accepted.

    ``accepted[r]`` counts the draft tokens round ``r`` accepted (before cutting the output at
    ``max_new_tokens`` or a stop token); ``proposed[r]`` is the length of that round's proposal.
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
    output = target(packed, layer_ids)
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
) -> Generation:
    """Greedy speculative decoding of ``prompt``: lossless by construction (see the module docstring).
    With ``sampling``, speculative sampling (:mod:`lightning_drafts.serving.sampling`): every emitted token
    is distributed as the target's own sampling would draw it."""
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
        proposal = _checked_proposal(speculator, speculator.propose(prefix), target.vocab_size, tokens.device)
        verified = _run_target(target, torch.cat([tokens, proposal]), layer_ids)
        if sampling is None:
            # verified.greedy[L - 1 + j] is the target's token at position L + j: its check of proposal[j].
            check = verified.greedy[tokens.numel() - 1 :]
            matches = (proposal == check[: proposal.numel()]).long().cumprod(0)
            count = int(matches.sum())
            emitted = torch.cat([proposal[:count], check[count : count + 1]])
        else:
            probs = sampling.probabilities(target.logits(verified.last_hidden_state[tokens.numel() - 1 :]))
            count, chosen = verify_sampled(probs, proposal, generator)
            emitted = tokens.new_tensor(chosen)
        accepted.append(count)
        proposed.append(int(proposal.numel()))
        generated.extend(int(t) for t in emitted)
        tokens = torch.cat([tokens, emitted])
        # Causal attention: the features of the accepted tokens from this pass are those of the new prefix.
        keep = tokens.numel() - 1
        features = tuple(h[:keep] for h in verified.hidden_states)
        last_hidden = verified.last_hidden_state[:keep]
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


def _cut(generated: list[int], max_new_tokens: int, stop: set[int]) -> list[int]:
    generated = generated[:max_new_tokens]
    for index, token in enumerate(generated):
        if token in stop:
            return generated[: index + 1]
    return generated
