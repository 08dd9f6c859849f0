"""EAGLE-3's LM head started from the target's (``lm_head_init: target``), trained or frozen
(``train_lm_head``): which rows it copies, when, what training and checkpoints keep, what the export proves."""

from __future__ import annotations

import pytest
import torch

from lightning_drafts import Eagle3Module, MLAEagle3Module
from lightning_drafts.eagle3.draft_base import Eagle3Draft
from lightning_drafts.workflows.export import validate_export
from tests.support import eagle3_checks as checks
from tests.support.builders import TINY_TARGETS

LLAMA = TINY_TARGETS["llama"]
TIED = {**LLAMA, "tie_word_embeddings": True}


def served_rows(draft: Eagle3Draft, target_head: torch.Tensor) -> torch.Tensor:
    """The target's LM-head rows in the order the draft's rows predict them, by the serving formula: draft
    row ``i`` is target id ``i + d2t[i]`` (vLLM's and SGLang's reading of ``d2t``), one row at a time."""
    d2t = draft.d2t.tolist()
    return torch.stack([target_head[i + d2t[i]] for i in range(draft.draft_vocab_size)])


@pytest.mark.parametrize("spec", [LLAMA, TIED], ids=["untied", "tied"])
def test_target_init_copies_the_targets_rows_of_the_draft_vocabulary(spec):
    module = checks.build(Eagle3Module, spec, lm_head_init="target")
    target_head = module.target.lm_head.weight
    if spec is TIED:
        assert module.target.lm_head.weight is module.target.input_embeddings.weight
    # The draft vocabulary is a scattered subset (frequencies() ranks ids out of order), so a copy of the
    # first rows, or of the rows in id order, differs from this.
    assert not torch.equal(module.draft.d2t, torch.zeros_like(module.draft.d2t))
    assert torch.equal(module.draft.lm_head.weight, served_rows(module.draft, target_head))
    assert module.draft.lm_head.weight.requires_grad
    # The full vocabulary: row i is target id i.
    full = Eagle3Module(spec, ttt_length=2, lm_head_init="target")
    assert torch.equal(full.draft.lm_head.weight, full.target.lm_head.weight)
    # The default stays the reference trainers' random start.
    random_start = checks.build(Eagle3Module, spec)
    assert not torch.equal(random_start.draft.lm_head.weight, served_rows(random_start.draft, target_head))


def test_the_mla_draft_starts_from_the_target_too():
    module = checks.build(MLAEagle3Module, TINY_TARGETS["deepseek_v3"], lm_head_init="target")
    assert torch.equal(module.draft.lm_head.weight, served_rows(module.draft, module.target.lm_head.weight))


def test_a_frozen_target_head_stays_the_targets_through_fit_checkpoint_and_export(tmp_path):
    # No frequencies: setup() chooses the vocabulary from the datamodule, and the rows follow that choice.
    module = checks.build(
        Eagle3Module, TIED, token_frequencies=None, lm_head_init="target", train_lm_head=False
    )
    fc_before = module.draft.fc.weight.detach().clone()
    assert set(module.init_fingerprints) == {"fc.weight"}
    trainer = checks.lightning_trainer(tmp_path)
    trainer.fit(module, datamodule=checks.RowsDataModule())
    target_rows = served_rows(module.draft, module.target.lm_head.weight)
    assert torch.equal(module.draft.lm_head.weight, target_rows)
    assert not torch.equal(module.draft.fc.weight, fc_before)
    trained = {id(p) for group in trainer.optimizers[0].param_groups for p in group["params"]}
    assert id(module.draft.lm_head.weight) not in trained and id(module.draft.fc.weight) in trained

    trainer.save_checkpoint(tmp_path / "draft.ckpt")
    restored = Eagle3Module.load_from_checkpoint(tmp_path / "draft.ckpt")
    assert not restored.draft.lm_head.weight.requires_grad
    assert torch.equal(restored.draft.lm_head.weight, target_rows)
    assert restored.init_fingerprints == module.init_fingerprints

    export = restored.export(tmp_path / "export")
    validate_export(export, restored.target)  # the frozen head is no "untrained" defect; fc proves training


def test_the_export_refuses_an_untrained_draft_whose_head_came_from_the_target(tmp_path):
    module = checks.build(Eagle3Module, LLAMA, lm_head_init="target", train_lm_head=False)
    export = module.export(tmp_path / "export")
    with pytest.raises(ValueError, match=r"fc\.weight.*bit-identical to its random initialisation"):
        validate_export(export, module.target)


def test_a_trained_target_head_moves_from_the_targets_rows():
    module = checks.build(Eagle3Module, LLAMA, lm_head_init="target")
    start = served_rows(module.draft, module.target.lm_head.weight)
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-2)
    batch = next(iter(checks.RowsDataModule().train_dataloader()))
    for _ in range(2):
        optimizer.zero_grad()
        module.compute_loss(batch).loss.backward()
        optimizer.step()
    assert not torch.equal(module.draft.lm_head.weight, start)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"lm_head_init": "zeros"}, "lm_head_init = 'zeros'; write random or target"),
        ({"train_lm_head": False}, "train_lm_head: false with lm_head_init: random"),
        ({"train_lm_head": "no"}, "train_lm_head = 'no'; it must be True or False"),
    ],
)
def test_lm_head_options_out_of_range_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        Eagle3Module(LLAMA, **options)


def test_a_target_head_with_a_bias_is_refused_for_target_init():
    module = checks.build(Eagle3Module, LLAMA)
    head = module.target.lm_head
    head.bias = torch.nn.Parameter(torch.zeros(head.out_features))
    module.hparams.lm_head_init = "target"
    with pytest.raises(ValueError, match="has a bias the draft's head cannot hold; use lm_head_init: random"):
        module.build_vocab_mapping(checks.frequencies())
