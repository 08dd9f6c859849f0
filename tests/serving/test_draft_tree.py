"""Tree drafting's family-agnostic parts against hand-worked examples: the tree grown from stub draft
distributions (SGLang's top-k expansion and best-nodes cut), the ancestor mask, the greedy walk, the
target's masked pass, and a scripted tree verified by a real target."""

from __future__ import annotations

import pytest
import torch

from lightning_drafts.core.batch import validate_batch
from lightning_drafts.serving.decode import greedy_generate, speculative_generate
from lightning_drafts.serving.draft_tree import DraftTree, TreeShape, TreeSpeculator, grow_tree
from lightning_drafts.serving.family import VerifiedPrefix
from lightning_drafts.training.target import FrozenTarget
from tests.families.eagle3.cases import sharpened_target
from tests.support.builders import VOCAB, random_docs

pytestmark = pytest.mark.usefixtures("one_thread")

OFFSET = 10  # stub draft id d is target id d + 10
FIRST = [0.5, 0.3, 0.1, 0.06, 0.04]
# The stub draft's next distribution after each path of target ids (it depends on every ancestor).
AFTER = {
    (10,): [0.1, 0.2, 0.55, 0.1, 0.05],
    (11,): [0.8, 0.1, 0.05, 0.03, 0.02],
    (10, 12): [0.05, 0.05, 0.1, 0.5, 0.3],
    (11, 10): [0.9, 0.04, 0.03, 0.02, 0.01],
}


class StubDraft:
    """Rows of paths: ``advance`` continues row ``rows[i]`` with ``tokens[i]`` and looks the path up."""

    def __init__(self) -> None:
        self.paths: list[tuple[int, ...]] = [()]
        self.calls: list[tuple[list[int], list[int]]] = []

    def advance(self, tokens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        self.calls.append((tokens.tolist(), rows.tolist()))
        self.paths = [self.paths[r] + (t,) for t, r in zip(tokens.tolist(), rows.tolist(), strict=True)]
        return torch.tensor([AFTER[p] for p in self.paths], dtype=torch.float64).log()


def _grow(num_draft_tokens: int) -> tuple[DraftTree, StubDraft]:
    stub = StubDraft()
    first = torch.tensor(FIRST, dtype=torch.float64).log()
    tree = grow_tree(first, stub.advance, TreeShape(3, 2, num_draft_tokens), lambda ids: ids + OFFSET)
    return tree, stub


def test_the_tree_keeps_the_best_nodes_of_the_topk_expansion():
    """By hand, scores as probability products. Depth 1: ids 0 (.5), 1 (.3). Depth 2: after 10 the best
    two are ids 2 (.5 * .55 = .275) and 1 (.10); after 11, ids 0 (.3 * .8 = .24) and 1 (.03); the next
    leaves are .275 (10, 12) and .24 (11, 10). Depth 3: after (10, 12) ids 3 (.1375) and 4 (.0825); after
    (11, 10) ids 0 (.216) and 1 (.0096). The five best of the ten: .5, .3, .275, .24, .216; the sixth
    best adds .1375."""
    tree, stub = _grow(6)
    assert stub.calls == [([10, 11], [0, 0]), ([12, 10], [0, 1])]
    assert tree.tokens.tolist() == [10, 11, 12, 10, 10]
    assert tree.parents.tolist() == [-1, -1, 0, 1, 3]
    assert tree.depths().tolist() == [1, 1, 2, 2, 3]
    wider, _ = _grow(7)
    assert wider.tokens.tolist() == [10, 11, 12, 10, 13, 10]
    assert wider.parents.tolist() == [-1, -1, 0, 1, 2, 3]


def test_topk_one_grows_the_greedy_chain():
    stub = StubDraft()
    first = torch.tensor(FIRST, dtype=torch.float64).log()
    tree = grow_tree(first, stub.advance, TreeShape.chain(3), lambda ids: ids + OFFSET)
    # 10 (argmax of FIRST), then argmax after (10,) = id 2, then after (10, 12) = id 3.
    assert tree.tokens.tolist() == [10, 12, 13] and tree.is_chain()


def test_each_node_attends_exactly_its_ancestors_and_itself():
    tree = DraftTree(torch.tensor([10, 11, 12, 10, 10]), torch.tensor([-1, -1, 0, 1, 3]))
    allowed = {0: {0}, 1: {1}, 2: {0, 2}, 3: {1, 3}, 4: {1, 3, 4}}
    mask = tree.ancestor_mask()
    for node, seen in allowed.items():
        assert set(mask[node].nonzero().flatten().tolist()) == seen


def test_greedy_acceptance_walks_the_matching_children():
    tree = DraftTree(torch.tensor([10, 11, 12, 10, 10]), torch.tensor([-1, -1, 0, 1, 3]))
    checks = torch.tensor([13, 10, 0, 10, 7])  # the target's greedy token after each node
    assert tree.accepted_path(11, checks) == [1, 3, 4]
    assert tree.accepted_path(10, checks) == [0]  # after node 0 the target wants 13: no such child
    assert tree.accepted_path(14, checks) == []
    # Node 2 holds 12 under node 0: a 12 wanted after node 1 does not reach it.
    assert tree.accepted_path(11, torch.tensor([0, 12, 0, 0, 0])) == [1]


def test_tree_settings_are_checked():
    assert TreeShape(3, 2, 10).candidates == 2 + 2 * 4
    with pytest.raises(ValueError, match=r"num_draft_tokens = 12.*\[2, 11\]"):
        TreeShape(3, 2, 12)
    with pytest.raises(ValueError, match="topk = 0"):
        TreeShape(3, 0, 2)
    with pytest.raises(ValueError, match="topk=6 exceeds the draft vocabulary of 5"):
        grow_tree(torch.zeros(5).log_softmax(-1), StubDraft().advance, TreeShape(1, 6, 2), lambda i: i)


def test_the_masked_pass_equals_a_causal_pass_along_each_branch():
    """Every node's final state and captured layer from the tree pass equal those of a plain causal pass
    over the context and the node's own root-to-node path: it saw its ancestors, at their positions,
    and nothing else."""
    target = FrozenTarget(sharpened_target("llama"))
    context = random_docs([5], seed=50)[0]
    tree = DraftTree(torch.tensor([3, 4, 5, 6, 7]), torch.tensor([-1, -1, 0, 1, 3]))
    width = context.numel() + 5
    allowed = torch.ones(width, width, dtype=torch.bool).tril()
    allowed[5:, 5:] = tree.ancestor_mask()
    positions = torch.cat([torch.arange(5), 4 + tree.depths()])
    masked = target.forward_with_mask(torch.cat([context, tree.tokens]), positions, allowed, (1,))
    for node, path in {0: [0], 1: [1], 2: [0, 2], 3: [1, 3], 4: [1, 3, 4]}.items():
        sequence = torch.cat([context, tree.tokens[path]])
        causal = target(validate_batch({"input_ids": sequence[None]}), (1,))
        assert_close_ulps(masked.last_hidden_state[0, 5 + node], causal.last_hidden_state[0, -1])
        assert_close_ulps(masked.hidden_states[0][0, 5 + node], causal.hidden_states[0][0, -1])


def assert_close_ulps(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to float32 rounding: sums of a few dozen terms through 2 layers, by different kernels,
    differ by a few ulps of the states' size; 64 ulps of the largest entry is far below any real mix-up
    (a wrong key or position moves the states by O(1))."""
    tolerance = 64 * torch.finfo(torch.float32).eps * float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=0, atol=tolerance)


class ScriptedTree:
    """Each round a tree whose right continuation is the second branch: node 0 wrong, node 1 right,
    node 2 (under 0) the right second token in the wrong place, node 3 (under 1) right, node 4 (under
    3) wrong. Greedy verification must accept nodes 1 and 3 and nothing else."""

    def __init__(self, reference: list[int], prompt_length: int) -> None:
        self.reference, self.prompt_length = reference, prompt_length
        self.num_steps, self.target_layer_ids = 3, (1,)

    def propose(self, prefix: VerifiedPrefix) -> torch.Tensor:
        raise AssertionError("a tree round never asks for a chain")

    def propose_tree(self, prefix: VerifiedPrefix, shape: TreeShape) -> DraftTree:
        done = prefix.tokens.numel() - self.prompt_length
        # The accepted nodes' features from the tree pass are a causal pass's over the verified tokens.
        causal = prefix.target(validate_batch({"input_ids": prefix.tokens[None, :-1]}), (1,))
        assert_close_ulps(prefix.hidden_states[0], causal.hidden_states[0][0])
        assert_close_ulps(prefix.last_hidden_state, causal.last_hidden_state[0])
        first, second, third = self.reference[done : done + 3]
        tokens = [(first + 1) % VOCAB, first, second, second, (third + 1) % VOCAB]
        return DraftTree(torch.tensor(tokens), torch.tensor([-1, -1, 0, 1, 3]))


def test_a_scripted_tree_is_verified_in_one_pass_and_stays_lossless():
    target = FrozenTarget(sharpened_target("llama"))
    prompt = random_docs([6], seed=30)[0]
    reference = greedy_generate(target, prompt, 40)
    speculator = ScriptedTree(reference, prompt.numel())
    assert isinstance(speculator, TreeSpeculator)
    generation = speculative_generate(target, speculator, prompt, 19, tree=TreeShape(3, 2, 6))
    assert generation.tokens == reference[:19]
    assert set(generation.accepted) == {2} and set(generation.proposed) == {5}
    assert len(generation.accepted) == 18 // 3  # the prefill's token, then 2 + 1 per round


def test_tree_rounds_refuse_what_they_cannot_do():
    target = FrozenTarget(sharpened_target("llama"))
    prompt = random_docs([6], seed=30)[0]

    class ChainOnly:
        num_steps, target_layer_ids = 2, (1,)

        def propose(self, prefix):
            return torch.zeros(2, dtype=torch.long)

    with pytest.raises(ValueError, match="ChainOnly drafts no trees"):
        speculative_generate(target, ChainOnly(), prompt, 4, tree=TreeShape(2, 2, 3))
    speculator = ScriptedTree(list(range(40)), prompt.numel())
    with pytest.raises(ValueError, match="5 nodes; steps 3, topk 2, draft tokens 4 allows 1..3"):
        speculative_generate(target, speculator, prompt, 4, tree=TreeShape(3, 2, 4))
