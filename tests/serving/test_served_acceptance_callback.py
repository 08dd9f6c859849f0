"""ServedAcceptanceCallback: at validation time every family's draft is exported and served, its real
acceptance logged beside the training estimate; a sharded strategy is refused before training starts."""

from __future__ import annotations

from contextlib import nullcontext

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from lightning_drafts import DFlashModule, DSparkModule
from lightning_drafts.callbacks import ServedAcceptanceCallback
from lightning_drafts.registry import REGISTRY
from lightning_drafts.serving.prompts import prompts_from_batch
from lightning_drafts.workflows.evaluate import evaluate_export
from tests.families.cases import CASES, FAMILIES
from tests.families.dflash.cases import perfect_module as perfect_dflash
from tests.families.dspark.cases import perfect_module as perfect_dspark
from tests.families.family_case import FamilyCase
from tests.support.builders import TINY_TARGETS, PromptRows, packed_row

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:target_layer_ids .* standard SGLang captures"),
]
RUNS = [
    pytest.param(family, CASES[cls], {}, id=cls.__name__) for family in FAMILIES for cls in family.modules
]
# A draft SGLang's DSparkDraftModel cannot serve (its own embedding / LM head copies, trained) is served
# from NeMo's layout.
RUNS.append(
    pytest.param(
        REGISTRY.for_architecture("DSparkDraftModel"),
        CASES[DSparkModule],
        {"freeze_embeddings": False},
        id="DSparkModule-unfrozen-embeddings-nemo-layout",
    )
)


@pytest.mark.parametrize(("family", "case", "options"), RUNS, indirect=["family"])
def test_the_callback_logs_served_acceptance_beside_the_training_estimate(
    family, case: FamilyCase, options, tmp_path
):
    module = case.build(TINY_TARGETS[case.targets[0]], **options)
    if options.get("freeze_embeddings") is False:
        # The build perturbs every trainable weight; unfrozen copies must start as the target's again.
        target = module.target
        module.draft.copy_target_weights(target.input_embeddings.weight, target.lm_head.weight, freeze=False)
    callback = ServedAcceptanceCallback(num_prompts=3, max_new_tokens=6)
    trainer = L.Trainer(
        max_steps=2,
        limit_val_batches=1,
        num_sanity_val_steps=1,
        accelerator="cpu",
        devices=1,
        logger=CSVLogger(tmp_path),
        callbacks=[callback],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loaders = (
        DataLoader(PromptRows(4, vocab=case.vocab), batch_size=2),
        DataLoader(PromptRows(2, vocab=case.vocab), batch_size=2),
    )
    nemo = "writing NeMo's Qwen3DSparkModel layout instead"
    with pytest.warns(UserWarning, match=nemo) if options else nullcontext():
        trainer.fit(module, *loaders)
    logged = trainer.logged_metrics
    assert "val/accept_len" in logged
    # The one validation run followed the last optimizer step, so the module still holds the weights it
    # served: the logged value is evaluate_export's on the same export and prompts, served again here.
    prompts = prompts_from_batch(next(iter(loaders[1])), 3, callback.max_prompt_tokens)
    with pytest.warns(UserWarning, match=nemo) if options else nullcontext():
        export = module.export(tmp_path / "again")
    report = evaluate_export(
        export, prompts, target=module.target, max_new_tokens=6, with_training_estimate=False
    )
    assert float(logged["val/served_accept_len"]) == pytest.approx(report.served.accept_len, rel=1e-6)
    # The sanity check does not count; the one real validation run does.
    assert callback.validation_runs == 1


def repeated_rows(block_lengths: tuple[int, int] = (5, 8)) -> list[dict]:
    """Rows of two documents, each one token repeated (a 5-token prompt, then 8 supervised tokens): the
    prompts the perfect drafts of tests.families.*.cases reach the maximum acceptance length on."""
    prompt, answer = block_lengths
    rows = []
    for tokens in ((3, 11), (40, 21)):
        row = packed_row([torch.full((prompt + answer,), t) for t in tokens], 2 * (prompt + answer))
        for start in (0, prompt + answer):
            row["loss_mask"][0, start : start + prompt] = 0
        rows.append({key: value[0] for key, value in row.items()})
    return rows


@pytest.mark.parametrize(
    "build", [perfect_dspark, lambda: perfect_dflash(DFlashModule)], ids=["DSparkModule", "DFlashModule"]
)
def test_a_perfect_draft_logs_the_maximum_served_acceptance_length(build, tmp_path):
    module = build()
    callback = ServedAcceptanceCallback(num_prompts=4, max_new_tokens=8)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=CSVLogger(tmp_path),
        callbacks=[callback],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.validate(module, DataLoader(repeated_rows(), batch_size=2))
    # Every proposal of every round is accepted: K proposals plus the target's bonus token.
    assert float(trainer.logged_metrics["val/served_accept_len"]) == CASES[type(module)].num_steps(module) + 1


def test_every_n_val_epochs_must_be_at_least_one():
    with pytest.raises(ValueError, match="every_n_val_epochs"):
        ServedAcceptanceCallback(every_n_val_epochs=0)


@pytest.mark.parametrize("strategy", ["fsdp1", "fsdp2"])
def test_the_callback_refuses_a_sharded_strategy_before_training(strategy):
    from types import SimpleNamespace

    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    sharded = FSDPStrategy() if strategy == "fsdp1" else ModelParallelStrategy()
    with pytest.raises(ValueError, match=f"the strategy is {type(sharded).__name__} \\(sharded\\)"):
        ServedAcceptanceCallback().setup(SimpleNamespace(strategy=sharded), None, "fit")
