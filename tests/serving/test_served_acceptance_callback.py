"""ServedAcceptanceCallback: at validation time every family's draft is exported and served, its real
acceptance logged beside the training estimate; a sharded strategy is refused before training starts."""

from __future__ import annotations

from contextlib import nullcontext

import lightning as L
import pytest
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader

from lightning_drafts import DSparkModule
from lightning_drafts.callbacks import ServedAcceptanceCallback
from lightning_drafts.registry import REGISTRY
from tests.builders import TINY_TARGETS, PromptRows
from tests.families.cases import CASES, FAMILIES
from tests.families.family_case import FamilyCase

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
    assert "val/accept_len" in logged and "val/served_accept_len" in logged
    assert 1.0 <= float(logged["val/served_accept_len"]) <= case.num_steps(module) + 1
    # The sanity check does not count; the one real validation run does.
    assert callback.validation_runs == 1


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
