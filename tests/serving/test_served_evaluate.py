"""Served acceptance measures what serving sees, for every family: a draft built to compute exactly what
the target computes reaches the maximum acceptance length; a defect the validator cannot tell from a
trained config (a self-consistent but wrong ``d2t``, another in-vocabulary mask token) collapses it while
decoding stays lossless; fewer tokens per round cut the proposals and the training estimate alike.

(That a trained export of every family decodes losslessly, and that a broken one is refused before
decoding, is the conformance suite's: tests/families/test_conformance.py.)"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import Tensor

from lightning_drafts import DFlash2Module, DFlashModule, Eagle3Module, MLAEagle3Module
from lightning_drafts.serving.decode import greedy_generate
from lightning_drafts.training.module import DraftModule
from lightning_drafts.workflows.evaluate import evaluate_export
from lightning_drafts.workflows.export import export_module, validate_export
from tests.families.cases import CASES
from tests.families.dflash.cases import perfect_module as perfect_dflash
from tests.families.dflash.cases import repeated_prompts
from tests.families.dspark.cases import perfect_module as perfect_dspark
from tests.families.eagle3.cases import perfect_module as perfect_eagle3
from tests.families.eagle3.cases import perfect_prompts
from tests.support.builders import VOCAB, rewrite_export

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:target_layer_ids .* standard SGLang captures"),
]

PerfectDraft = Callable[[], tuple[DraftModule, list[Tensor]]]


def eagle3_draft(module_class: type, kind: str) -> PerfectDraft:
    """See ``tests.families.eagle3.cases.perfect_module``: the draft copies the target's own computation
    from the captured layer; prompts end in tokens whose draft id differs from their target id."""

    def build() -> tuple[DraftModule, list[Tensor]]:
        module = perfect_eagle3(module_class, kind)
        return module, perfect_prompts(module)

    return build


def block_draft(build: Callable[[], DraftModule]) -> PerfectDraft:
    """See ``perfect_module`` in tests.families.dflash.cases / dspark.cases: the draft carries the
    target's own last-layer (final-norm) features to every slot; prompts repeat one token."""
    return lambda: (build(), repeated_prompts())


# name -> (the draft and its prompts, the export layout)
PERFECT: dict[str, tuple[PerfectDraft, str | None]] = {
    "Eagle3Module": (eagle3_draft(Eagle3Module, "llama"), None),
    "MLAEagle3Module": (eagle3_draft(MLAEagle3Module, "deepseek_v3"), None),
    "DFlashModule": (block_draft(lambda: perfect_dflash(DFlashModule)), None),
    "DFlash2Module": (block_draft(lambda: perfect_dflash(DFlash2Module)), None),
    "DSparkModule-specforge": (block_draft(perfect_dspark), "specforge"),
    "DSparkModule-nemo": (block_draft(perfect_dspark), "nemo"),
}


def perfect_export(name: str, tmp_path: Path) -> tuple[DraftModule, list[Tensor], Path, int]:
    build, layout = PERFECT[name]
    module, prompts = build()
    export = export_module(module, tmp_path / "draft", layout=layout)
    return module, prompts, export, CASES[type(module)].num_steps(module)


@pytest.mark.parametrize("name", list(PERFECT))
def test_a_perfect_draft_reaches_the_maximum_acceptance_length(name, tmp_path):
    module, prompts, export, steps = perfect_export(name, tmp_path)
    for prompt in prompts:
        assert greedy_generate(module.target, prompt, 6) == [int(prompt[-1])] * 6, "the target must repeat"
    report = evaluate_export(export, prompts, target=module.target, max_new_tokens=16, stop_token_ids=())

    assert report.served.accept_len == steps + 1
    assert report.served.prefix_rate == [1.0] * steps
    assert report.served.position_accuracy == [1.0] * steps
    assert report.training.accept_len == pytest.approx(steps + 1)
    assert report.generations == [[int(p[-1])] * 16 for p in prompts]


def identity_d2t(tensors: dict) -> None:
    """Draft id i -> target id i, what engines do without ``d2t``: self-consistent, and wrong."""
    tensors["d2t"] = torch.zeros_like(tensors["d2t"])
    tensors["t2d"] = torch.arange(VOCAB) < tensors["d2t"].numel()


def mask_token_7(section: str | None) -> Callable[[dict], None]:
    """Another in-vocabulary mask token, where the layout keeps it (``dflash_config`` or the top level)."""
    return lambda config: (config[section] if section else config).update(mask_token_id=7)


# name -> (perfect draft, config edit, tensor edit, the served acceptance length it collapses to)
SILENT_DEFECTS = {
    "Eagle3Module-d2t-read-as-the-first-draft-ids": ("Eagle3Module", None, identity_d2t, 1.0),
    "DFlashModule-another-mask-token": ("DFlashModule", mask_token_7("dflash_config"), None, 1.0),
    "DFlash2Module-another-mask-token": ("DFlash2Module", mask_token_7("dflash_config"), None, 1.0),
    # Slots 1..K-1 now carry a real token's embedding and fail; slot 0 holds the anchor, not the mask,
    # so it still proposes right: acceptance falls from K + 1 to 2.
    "DSparkModule-specforge-another-mask-token": (
        "DSparkModule-specforge",
        mask_token_7("dflash_config"),
        None,
        2.0,
    ),
    "DSparkModule-nemo-another-mask-token": ("DSparkModule-nemo", mask_token_7(None), None, 2.0),
}


@pytest.mark.parametrize("name", list(SILENT_DEFECTS))
def test_a_defect_the_validator_cannot_see_collapses_served_acceptance(name, tmp_path):
    perfect, config_edit, tensor_edit, collapsed = SILENT_DEFECTS[name]
    module, prompts, export, steps = perfect_export(perfect, tmp_path)
    broken = rewrite_export(export, tmp_path / "broken", config_edit, tensor_edit)
    validate_export(broken, module.target)
    good = evaluate_export(
        export, prompts, target=module.target, max_new_tokens=8, with_training_estimate=False
    )
    bad = evaluate_export(
        broken, prompts, target=module.target, max_new_tokens=8, with_training_estimate=False
    )
    assert good.served.accept_len == steps + 1
    assert bad.served.accept_len == collapsed and bad.served.prefix_rate[int(collapsed) - 1] == 0.0
    assert bad.generations == good.generations  # still lossless: the target corrects every token


@pytest.mark.parametrize("name", ["DFlashModule", "DSparkModule-specforge"])
def test_fewer_steps_than_the_block_cut_proposals_and_the_estimate(name, tmp_path):
    module, prompts, export, steps = perfect_export(name, tmp_path)
    report = evaluate_export(
        export, prompts, target=module.target, max_new_tokens=10, num_steps=2, stop_token_ids=()
    )
    assert report.served.accept_len == 3 and len(report.training.prefix_rate) == 2
    assert report.training.accept_len == pytest.approx(3)
    with pytest.raises(ValueError, match=f"num_steps = {steps + 1} must be in"):
        evaluate_export(export, prompts, target=module.target, num_steps=steps + 1)
