"""The built-in decode's sampled rounds, replayed one by one against the draft and the target.

A trained EAGLE-3 drafts deterministically (its argmax chain), so speculative sampling's rule is: accept the
drafted token x with probability p(x), else emit a token drawn from p without x. Two consequences are checked
on every round the decode reports, from a fresh target pass over the round's context (no state of the decode
is reused):

* counting: a round that reports ``a`` accepted tokens emitted exactly the first ``a`` drafted tokens and then
  a token other than the next drafted one (a rejected token is never emitted in its place);
* the rule: the accepted first tokens are a sum of Bernoulli(p(x)) draws, one per round, so their count is
  within four standard deviations (sqrt of the sum of p(x) (1 - p(x))) of the sum of p(x).
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_drafts.core.batch import validate_batch
from lightning_drafts.registry import REGISTRY
from lightning_drafts.serving.decode import as_prompt
from lightning_drafts.serving.family import VerifiedPrefix
from lightning_drafts.serving.sampling import Sampling
from lightning_drafts.training.target import FrozenTarget
from lightning_drafts.workflows.evaluate import evaluate_export
from tests.serving.vllm_cases import TARGETS, prompts, trained_export

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 3
# A peaked distribution (most first tokens accepted), so that a wrong acceptance probability moves the count
# by many standard deviations.
SAMPLING = Sampling(temperature=0.5)


def test_each_sampled_round_emits_its_accepted_draft_tokens_and_accepts_with_the_targets_probability(
    tmp_path,
):
    export = trained_export("eagle3", TARGETS["llama"], tmp_path / "export")
    target = FrozenTarget(TARGETS["llama"])
    speculator = REGISTRY.for_export(export).load_speculator(export, target, STEPS)
    layer_ids = tuple(speculator.target_layer_ids)
    sampled = [prompt for seed in range(1, 9) for prompt in prompts(seed=seed)]
    report = evaluate_export(
        export,
        sampled,
        target=TARGETS["llama"],
        max_new_tokens=32,
        num_steps=STEPS,
        seed=3,
        stop_token_ids=[],
        with_training_estimate=False,
        sampling=SAMPLING,
    )
    first_accepted, expected, variance, rounds = 0, 0.0, 0.0, 0
    with torch.no_grad():
        for prompt, tokens, accepted in zip(sampled, report.generations, report.accepted, strict=True):
            # The prefill emits tokens[0]; each round then emits its accepted tokens and one more.
            position = 1
            for count in accepted:
                context = torch.cat([as_prompt(prompt, target), torch.tensor(tokens[:position])])
                output = target(
                    validate_batch({"input_ids": context[None]}, vocab_size=target.vocab_size), layer_ids
                )
                features = tuple(h[0, :-1] for h in output.hidden_states)
                prefix = VerifiedPrefix(context, features, output.last_hidden_state[0, :-1], target)
                drafted = [int(t) for t in speculator.propose(prefix)]
                # The last round's tokens stop at max_new_tokens.
                emitted = tokens[position : position + count + 1]
                assert emitted[:count] == drafted[: min(count, len(emitted))], (count, drafted, emitted)
                if count < STEPS and len(emitted) > count:
                    assert emitted[count] != drafted[count], (count, drafted, emitted)
                probs = SAMPLING.probabilities(target.logits(output.last_hidden_state[0, -1:]))
                p = float(probs[0, drafted[0]])
                first_accepted += count > 0
                expected += p
                variance += p * (1 - p)
                rounds += 1
                position += count + 1
    assert rounds == report.rounds
    # Not a vacuous check: some first tokens were accepted and some rejected.
    assert 0 < first_accepted < rounds
    assert abs(first_accepted - expected) <= 4 * math.sqrt(variance), (first_accepted, expected, variance)
