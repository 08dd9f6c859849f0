"""EAGLE-3 tree drafting from an export: every node is one of the top-k draft tokens after its own
ancestors, the decode's output is the target's greedy output for every tree shape, top-k 1 is today's
chain decode, and a tree accepts a token the chain misses."""

from __future__ import annotations

import pytest
import torch

from lightning_drafts import Eagle3Module, MLAEagle3Module
from lightning_drafts.core.batch import validate_batch
from lightning_drafts.eagle3.speculate import Eagle3Speculator, load_speculator
from lightning_drafts.serving.decode import greedy_generate, speculative_generate
from lightning_drafts.serving.draft_tree import TreeShape
from lightning_drafts.serving.family import VerifiedPrefix
from lightning_drafts.serving.sampling import Sampling
from tests.families.eagle3.cases import perfect_module, perfect_prompts, sharpened_target, trained_module
from tests.support.builders import random_docs
from tests.support.eagle3_checks import frequencies

pytestmark = pytest.mark.usefixtures("one_thread")

SAMPLING = Sampling(temperature=0.8)
SHAPES = [TreeShape(3, 2, 6), TreeShape(4, 3, 10), TreeShape(2, 4, 8), TreeShape(3, 1, 3)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Eagle3Module, Eagle3Speculator]:
    module = trained_module(Eagle3Module, "llama")
    export = module.export(tmp_path_factory.mktemp("trained") / "draft")
    return module, load_speculator(export, module.target, 3)


def _prefix(module: Eagle3Module, speculator: Eagle3Speculator, tokens: torch.Tensor) -> VerifiedPrefix:
    features = module.target(validate_batch({"input_ids": tokens[None, :-1]}), speculator.target_layer_ids)
    return VerifiedPrefix(
        tokens, tuple(h[0] for h in features.hidden_states), features.last_hidden_state[0], module.target
    )


@pytest.mark.parametrize(
    ("module_class", "name"), [(Eagle3Module, "llama"), (MLAEagle3Module, "deepseek_v3")]
)
def test_every_node_is_a_topk_draft_token_after_its_own_ancestors(module_class, name, tmp_path):
    """The chain forced along a node's ancestors (one row, no reordering; it equals training's unroll:
    test_evaluate_eagle3.py) gives the draft distribution the node was drawn from: the node must be among
    its top-k. Reordered rows that lost their ancestors' keys or hidden states draw children from another
    branch's distribution. The draft is moved well off its initialisation, so branches draw different
    children, but not so far that its attention saturates on one context key and the diagonal keys stop
    counting (at a shift of 1.0 a swap of two rows' diagonal keys changed no score)."""
    torch.manual_seed(0)
    module = module_class(
        sharpened_target(name), ttt_length=3, draft_vocab_size=48, token_frequencies=frequencies()
    )
    with torch.no_grad():
        for parameter in module.draft.parameters():
            if parameter.requires_grad:
                parameter.add_(0.3 * torch.randn_like(parameter))
    speculator = load_speculator(module.export(tmp_path / "draft"), module.target, 3)
    tokens = random_docs([9], seed=61)[0]
    prefix = _prefix(module, speculator, tokens)
    shape = TreeShape(3, 3, 22)  # every candidate kept: 3 + 9 + 9 nodes
    tree = speculator.propose_tree(prefix, shape)
    parents, depths = tree.parents.tolist(), tree.depths().tolist()
    assert max(depths) == 3 and sum(d == 3 for d in depths) > 1  # branching at the deepest depth
    for node, depth in enumerate(depths):
        path = [node]
        while parents[path[0]] >= 0:
            path.insert(0, parents[path[0]])
        chain = Eagle3Speculator(speculator.draft, speculator.target_layer_ids, depth)
        _, logits = chain.chain(prefix, forced=tree.tokens[path[:-1]])
        log_probs = logits.float().log_softmax(-1)
        best = log_probs[-1].topk(shape.topk).indices
        allowed = (best + speculator.draft.d2t[best]).tolist()
        assert int(tree.tokens[node]) in allowed, (node, path)
        # Its score: its parent's plus its own log-probability under the forced chain. Batched rows and
        # one row round differently: a few float32 ulps of the logits' size per depth.
        own = float(log_probs[-1, best[allowed.index(int(tree.tokens[node]))]])
        want = own + (float(tree.scores[parents[node]]) if parents[node] >= 0 else 0.0)
        tolerance = 64 * torch.finfo(torch.float32).eps * depth * float(logits.abs().max())
        assert abs(float(tree.scores[node]) - want) <= tolerance, (node, float(tree.scores[node]), want)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s.label())
def test_tree_decoding_reproduces_the_targets_greedy_output(trained, shape):
    module, speculator = trained
    for prompt in random_docs([6, 9], seed=5):
        reference = greedy_generate(module.target, prompt, 16)
        generation = speculative_generate(module.target, speculator, prompt, 16, tree=shape)
        assert generation.tokens == reference
        assert set(generation.proposed) == {shape.num_draft_tokens - 1}


def test_topk_one_with_a_full_chain_is_the_chain_decode(trained, tmp_path):
    module, speculator = trained
    perfect = perfect_module(Eagle3Module, "llama")
    with_draft = load_speculator(perfect.export(tmp_path / "draft"), perfect.target, 3)
    cases = [(module, speculator, p) for p in random_docs([6, 9], seed=5)]
    cases += [(perfect, with_draft, p) for p in perfect_prompts(perfect)[:2]]
    accepted = []
    for owner, drafter, prompt in cases:
        chain = speculative_generate(owner.target, drafter, prompt, 16)
        tree = speculative_generate(owner.target, drafter, prompt, 16, tree=TreeShape.chain(3))
        assert (tree.tokens, tree.accepted, tree.proposed) == (chain.tokens, chain.accepted, chain.proposed)
        accepted += chain.accepted
        # Sampled, from the same seed: the same coins fall on the same tokens.
        sampled = [
            speculative_generate(
                owner.target, drafter, prompt, 16, (), SAMPLING, torch.Generator().manual_seed(5), tree
            )
            for tree in (None, TreeShape.chain(3))
        ]
        assert (sampled[0].tokens, sampled[0].accepted) == (sampled[1].tokens, sampled[1].accepted)
    assert max(accepted) == 3  # the perfect draft's chains are accepted whole: every depth compared


def test_a_tree_accepts_the_drafts_second_choice(tmp_path):
    """The perfect draft with noise on its LM head: the target's token (it repeats the last one) is the
    draft's second choice, at every depth alike. The chain accepts nothing; a top-2 tree holds the second
    choice at depth 1 and accepts it every round, and stays lossless."""
    torch.manual_seed(1)
    module = perfect_module(Eagle3Module, "llama")
    with torch.no_grad():
        module.draft.lm_head.weight.add_(2.0 * torch.randn_like(module.draft.lm_head.weight))
    speculator = load_speculator(module.export(tmp_path / "draft"), module.target, 3)
    prompt = perfect_prompts(module)[0]
    reference = greedy_generate(module.target, prompt, 12)
    prefix = _prefix(module, speculator, torch.cat([prompt, torch.tensor(reference[:1])]))
    _, logits = speculator.chain(prefix)
    ranked = logits[0].argsort(descending=True)[:2]
    assert (ranked + speculator.draft.d2t[ranked]).tolist()[1] == reference[1]  # the second choice
    chain = speculative_generate(module.target, speculator, prompt, 12)
    tree = speculative_generate(module.target, speculator, prompt, 12, tree=TreeShape(3, 2, 6))
    assert chain.tokens == tree.tokens == reference
    assert set(chain.accepted) == {0} and set(tree.accepted) == {1}
