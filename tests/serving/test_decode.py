"""The family-agnostic serving loop: greedy verification accepts the longest matching prefix of any
speculator's proposal and refuses a malformed one; prompts come from a batch's unsupervised heads or a
JSONL file."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_drafts.serving.decode import greedy_generate, speculative_generate
from lightning_drafts.serving.family import Speculator, VerifiedPrefix
from lightning_drafts.serving.prompts import load_prompts_jsonl, prompts_from_batch
from lightning_drafts.training.target import FrozenTarget
from tests.families.eagle3.cases import sharpened_target
from tests.support.builders import VOCAB, packed_row, random_docs, stack_rows

pytestmark = pytest.mark.usefixtures("one_thread")


class ScriptedSpeculator:
    """Proposes the reference continuation, right for ``correct`` tokens per round, then wrong."""

    def __init__(self, reference: list[int], prompt_length: int, num_steps: int, correct: int) -> None:
        self.reference, self.prompt_length = reference, prompt_length
        self.num_steps, self.correct = num_steps, correct
        self.target_layer_ids = (2,)

    def propose(self, prefix: VerifiedPrefix) -> torch.Tensor:
        done = prefix.tokens.numel() - self.prompt_length
        assert prefix.hidden_states[0].shape[0] == prefix.tokens.numel() - 1
        right = torch.tensor(self.reference[done : done + self.num_steps])
        wrong = (right + 1) % VOCAB
        return torch.where(torch.arange(right.numel()) < self.correct, right, wrong)


@pytest.mark.parametrize("correct", [4, 2, 0])
def test_the_verify_loop_accepts_the_longest_matching_prefix(correct):
    target = FrozenTarget(sharpened_target("llama"))
    prompt = random_docs([6], seed=30)[0]
    reference = greedy_generate(target, prompt, 40)
    speculator = ScriptedSpeculator(reference, prompt.numel(), num_steps=4, correct=correct)
    assert isinstance(speculator, Speculator)
    generation = speculative_generate(target, speculator, prompt, max_new_tokens=21)
    assert generation.tokens == reference[:21]
    assert set(generation.accepted) == {correct} and set(generation.proposed) == {4}
    # One token from the prefill, then correct + 1 per round.
    assert len(generation.accepted) == -(-20 // (correct + 1))


def test_a_speculator_returning_bad_proposals_is_refused():
    target = FrozenTarget(sharpened_target("llama"))

    class TooMany(ScriptedSpeculator):
        def propose(self, prefix):
            return torch.zeros(self.num_steps + 1, dtype=torch.long)

    class DraftIds(ScriptedSpeculator):
        def propose(self, prefix):
            return torch.tensor([VOCAB + 3])

    prompt = random_docs([4], seed=31)[0]
    with pytest.raises(ValueError, match="more than num_steps=2"):
        speculative_generate(target, TooMany([], 4, 2, 0), prompt, 5)
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        speculative_generate(target, DraftIds([], 4, 2, 0), prompt, 5)


def test_prompts_are_the_tokens_before_each_documents_first_supervised_token(tmp_path):
    docs = random_docs([7, 6, 5], seed=40)
    batch = stack_rows([packed_row(docs[:2], 16), packed_row(docs[2:], 16)])
    batch["loss_mask"][0, :3] = 0  # doc 0: a 3-token prompt
    batch["loss_mask"][0, 7:9] = 0  # doc 1: a 2-token prompt
    batch["loss_mask"][1, :] = 0  # doc 2: nothing supervised, no prompt
    prompts = prompts_from_batch(batch, limit=5)
    assert [p.tolist() for p in prompts] == [docs[0][:3].tolist(), docs[1][:2].tolist()]
    lines = [json.dumps(docs[0].tolist()), json.dumps({"prompt_ids": [5, 6]}), ""]
    lines.append(json.dumps({"input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1]}))
    (tmp_path / "prompts.jsonl").write_text("\n".join(lines))
    loaded = load_prompts_jsonl(tmp_path / "prompts.jsonl")
    assert [p.tolist() for p in loaded] == [docs[0].tolist(), [5, 6], [1, 2]]
