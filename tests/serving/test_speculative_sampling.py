"""Speculative sampling keeps the target's distribution: on a tiny target (6 ids, so every 3-token
continuation can be enumerated), the sampled speculative decode's continuations, of chains and of token
trees, are distributed as the target's own sampling, computed exactly from its probabilities.

The target's head is sharpened (its weights x15) so that a few continuations carry most of the mass: the
draft's first proposal (the likeliest token) is then mostly accepted and its second mostly rejected, and a
wiring fault in the decode moves more mass than the bound allows. The acceptance rule itself is checked on
more samples, one round at a time (drawing the rejected token again, instead of from the residual, fails
that test; verifying with the distributions one position early fails the decode's).

The bound: for N samples of a distribution p over K outcomes, the empirical distribution's total-variation
distance TV has E[TV] <= 1/2 sum_x sqrt(p(x)(1 - p(x)) / N) (Jensen, per outcome), and TV moves by at most
1/N when one sample changes, so P(TV > E[TV] + t) <= exp(-2 N t^2) (McDiarmid). With t =
sqrt(ln(1/delta) / (2N)), delta = 1e-4, a correct sampler exceeds the bound with probability below 1e-4;
the samples are seeded, so the test is also deterministic."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from lightning_drafts.serving.decode import greedy_generate, speculative_generate
from lightning_drafts.serving.draft_tree import DraftTree, TreeShape
from lightning_drafts.serving.family import VerifiedPrefix
from lightning_drafts.serving.sampling import Sampling, verify_sampled
from lightning_drafts.training.target import FrozenTarget

pytestmark = pytest.mark.usefixtures("one_thread")
V = 6
NEW = 3
SAMPLES = 600
DELTA = 1e-4
SHARPEN = 15.0
TARGET = {
    "model_type": "llama",
    "vocab_size": V,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}
SAMPLING = Sampling(temperature=0.5, top_p=0.9)


class ArgmaxThenNext:
    """A deterministic draft: the target's most likely next token, then that token + 1 (often wrong)."""

    num_steps = 2
    target_layer_ids = (0,)

    def propose(self, prefix: VerifiedPrefix) -> torch.Tensor:
        first = int(prefix.target.logits(prefix.last_hidden_state[-1:]).argmax())
        return torch.tensor([first, (first + 1) % V])


def exact_distribution(target: FrozenTarget, prompt: torch.Tensor) -> dict[tuple[int, ...], float]:
    """P(t1, t2, t3) = p(t1) p(t2 | t1) p(t3 | t1 t2) of the target's own sampling, by enumeration."""

    def next_probs(prefix: tuple[int, ...]) -> torch.Tensor:
        ids = torch.cat([prompt, torch.tensor(prefix, dtype=torch.long)])
        with torch.no_grad():  # the Hugging Face model's own forward, not the decode's path
            return SAMPLING.probabilities(target.model(input_ids=ids[None]).logits[0, -1])

    table: dict[tuple[int, ...], float] = {}
    for prefix in itertools.product(range(V), repeat=NEW - 1):
        first = next_probs(())[prefix[0]]
        second = next_probs(prefix[:1])[prefix[1]]
        last = next_probs(prefix)
        for token in range(V):
            table[(*prefix, token)] = float(first * second * last[token])
    return table


def total_variation(samples: list[tuple[int, ...]], exact: dict[tuple[int, ...], float]) -> float:
    counts: dict[tuple[int, ...], int] = {}
    for sample in samples:
        counts[sample] = counts.get(sample, 0) + 1
    return 0.5 * sum(abs(counts.get(x, 0) / len(samples) - p) for x, p in exact.items())


def tv_bound(exact: dict[tuple[int, ...], float], n: int) -> float:
    mean = 0.5 * sum(math.sqrt(p * (1 - p) / n) for p in exact.values())
    return mean + math.sqrt(math.log(1 / DELTA) / (2 * n))


@pytest.mark.parametrize("tree", [None, TreeShape(2, 2, 7)], ids=["chain", "tree"])
def test_speculative_sampling_draws_the_targets_own_distribution(tree):
    torch.manual_seed(3)
    target = FrozenTarget(TARGET, attn_backend="sdpa")
    with torch.no_grad():
        target.lm_head.weight.mul_(SHARPEN)
    prompt = torch.tensor([1, 4, 2])
    exact = exact_distribution(target, prompt)
    assert sum(exact.values()) == pytest.approx(1.0) and max(exact.values()) < 0.5
    generator = torch.Generator().manual_seed(0)
    rounds: list[int] = []
    samples = []
    for _ in range(SAMPLES):
        speculator = ArgmaxThenNext() if tree is None else TopTwoTree()
        generation = speculative_generate(target, speculator, prompt, NEW, (), SAMPLING, generator, tree)
        samples.append(tuple(generation.tokens))
        rounds += generation.accepted
    bound = tv_bound(exact, SAMPLES)
    assert total_variation(samples, exact) < bound, (total_variation(samples, exact), bound)
    assert {0, 1, 2} <= set(rounds)  # rejections at either proposed token, and full acceptances
    if tree is not None:
        return
    # The target alone, sampled (the baseline evaluate times), on fewer samples.
    plain = [
        tuple(greedy_generate(target, prompt, NEW, (), SAMPLING, generator)) for _ in range(SAMPLES // 4)
    ]
    assert total_variation(plain, exact) < tv_bound(exact, SAMPLES // 4)


def test_the_acceptance_rule_emits_each_token_with_its_target_probability():
    """One round, one proposed token x: accepted with p(x), else drawn from p without x; the emitted token is
    distributed as p whatever x is (here the likeliest, a middling and an impossible token)."""
    p = torch.tensor([0.5, 0.25, 0.125, 0.125, 0.0], dtype=torch.float64)
    probs = torch.stack([p, torch.full((5,), 0.2, dtype=torch.float64)])
    n = 10000
    generator = torch.Generator().manual_seed(1)
    exact = {(i,): float(p[i]) for i in range(5)}
    for proposed in (0, 2, 4):
        chain = DraftTree.chain(torch.tensor([proposed]))
        first = [(verify_sampled(probs, chain, generator)[1][0],) for _ in range(n)]
        assert total_variation(first, exact) < tv_bound(exact, n), proposed


def test_the_tree_rule_emits_each_token_with_its_target_probability():
    """Two children of the root, x then y: x is accepted with p(x), y with p(y) (one coin, running sums),
    else a token is drawn from p without both; the emitted token is distributed as p for any pair, the
    impossible token included. Drawing the residual with only the last rejected child removed, or
    accepting each child with its own coin, fails this."""
    p = torch.tensor([0.5, 0.25, 0.125, 0.125, 0.0], dtype=torch.float64)
    probs = torch.stack([p, *[torch.full((5,), 0.2, dtype=torch.float64)] * 2])
    n = 10000
    generator = torch.Generator().manual_seed(2)
    exact = {(i,): float(p[i]) for i in range(5)}
    for pair in ((0, 1), (2, 0), (4, 3)):
        tree = DraftTree(torch.tensor(pair), torch.tensor([-1, -1]))
        first = [(verify_sampled(probs, tree, generator)[1][0],) for _ in range(n)]
        assert total_variation(first, exact) < tv_bound(exact, n), pair


class TopTwoTree:
    """A deterministic tree: the target's two likeliest next tokens, each with two children (that token
    + 1 and + 2): the second branch is taken whenever the coin passes the first child's mass."""

    num_steps = 2
    target_layer_ids = (0,)

    def propose(self, prefix: VerifiedPrefix) -> torch.Tensor:
        raise AssertionError("a tree round never asks for a chain")

    def propose_tree(self, prefix: VerifiedPrefix, shape: TreeShape) -> DraftTree:
        first, second = prefix.target.logits(prefix.last_hidden_state[-1]).topk(2).indices.tolist()
        tokens = [first, second, (first + 1) % V, (first + 2) % V, (second + 1) % V, (second + 2) % V]
        return DraftTree(torch.tensor(tokens), torch.tensor([-1, -1, 0, 0, 1, 1]))
