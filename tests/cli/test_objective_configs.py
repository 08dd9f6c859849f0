"""The quickstart configs take every objective option on the command line (`fit --config=...`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from lightning_drafts.cli.fit import DraftCLI, run_cli
from lightning_drafts.datamodules import PackedChatDataModule
from lightning_drafts.dflash.objectives import LOSS_TYPES
from lightning_drafts.eagle3.step_objective import LK_LOSS_TYPES
from lightning_drafts.training.module import DraftModule
from tests.support.builders import packed_row, random_docs

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart"
OPTIONS = [
    *((config, "loss_type", value) for config in ("dflash", "dflash2") for value in LOSS_TYPES),
    *((config, "lk_loss_type", value) for config in ("eagle3", "mla_eagle3") for value in LK_LOSS_TYPES),
]


def arguments(config: str, name: str, value: str | None) -> list[str]:
    return ["fit", f"--config={QUICKSTART / f'{config}.yaml'}", f"--model.init_args.{name}={value}"]


@pytest.mark.parametrize("config, name, value", OPTIONS, ids=lambda v: str(v))
def test_every_objective_parses_from_a_quickstart_config(config, name, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_cli([*arguments(config, name, "null" if value is None else value), "--print_config"])
    assert exit_info.value.code in (0, None)
    assert yaml.safe_load(capsys.readouterr().out)["model"]["init_args"][name] == value


@pytest.mark.parametrize(
    "config, name, value, attribute",
    [
        ("dflash", "loss_type", "dpace-continuation-value-only", "loss_type"),
        ("dflash2", "loss_type", "lk-lambda", "loss_type"),
        ("eagle3", "lk_loss_type", "lambda", "lk_loss_type"),
        ("mla_eagle3", "lk_loss_type", "alpha", "lk_loss_type"),
    ],
)
def test_the_cli_builds_the_module_with_the_objective(config, name, value, attribute):
    def build(args: list[str]) -> DraftModule:
        cli = DraftCLI(
            DraftModule,
            PackedChatDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            args=args,
            run=False,
        )
        return cli.model

    chosen, default = build(arguments(config, name, value)[1:]), build(arguments(config, name, value)[1:2])
    assert getattr(chosen.objective, attribute) == value
    # The option reaches the loss: the same weights on the same batch (and anchors) give another loss.
    weights = chosen.state_dict(), default.state_dict()
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][key], weights[1][key]) for key in weights[0])
    batch = packed_row(random_docs([11, 9], vocab=200, seed=4), 24)
    extra = {}
    if hasattr(chosen, "sample_anchors"):
        extra["anchors"] = chosen.sample_anchors(batch, generator=torch.Generator().manual_seed(0))
    if hasattr(chosen, "build_vocab_mapping"):
        for module in (chosen, default):
            module.build_vocab_mapping(torch.bincount(batch["input_ids"].flatten(), minlength=2048))
    with torch.no_grad():
        losses = [float(module.compute_loss(batch, **extra).loss) for module in (chosen, default)]
    assert losses[0] != pytest.approx(losses[1], rel=1e-4), losses


@pytest.mark.parametrize(
    "config, name, value, match",
    [
        ("dflash", "loss_type", "dpace_p", r"loss_type 'dpace_p' is unknown; choose one of"),
        ("eagle3", "lk_loss_type", "beta", r"lk_loss_type 'beta' is unknown; choose one of"),
    ],
)
def test_an_unknown_objective_in_a_config_fails_naming_the_value(config, name, value, match):
    with pytest.raises(ValueError, match=match):
        DraftCLI(
            DraftModule,
            PackedChatDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            args=arguments(config, name, value)[1:],
            run=False,
        )
