"""The CLI: config errors name their key, family defaults fill a config, recipes parse, `validate` runs.

(Every family's quickstart config fitting, logging and exporting through `lightning-drafts` is the
conformance suite's: tests/families/test_conformance.py.)"""

from __future__ import annotations

from argparse import ArgumentError
from pathlib import Path

import pytest
import torch
import yaml

from lightning_drafts.cli.main import run_cli

ROOT = Path(__file__).resolve().parents[2]
QUICKSTARTS = sorted((ROOT / "configs" / "quickstart").glob("*.yaml"))
RECIPES = sorted((ROOT / "configs" / "recipes").glob("*.yaml"))
REAL = sorted((ROOT / "configs" / "real").glob("*.yaml"))


def short_fit(config: Path, save_dir: Path) -> list[str]:
    return [
        "fit",
        f"--config={config}",
        "--trainer.max_steps=4",
        "--trainer.val_check_interval=2",
        "--trainer.limit_val_batches=1",
        "--trainer.log_every_n_steps=1",
        f"--trainer.logger.init_args.save_dir={save_dir}",
        "--data.init_args.max_documents=200",
        f"--data.init_args.cache_dir={save_dir / 'cache'}",
    ]


def test_a_misspelled_config_key_names_the_key(tmp_path):
    # Raised, not printed with the usage and exited: the command prints it as one message, a notebook
    # gets the exception.
    with pytest.raises(ArgumentError, match="ttt_lenght"):
        run_cli([*short_fit(QUICKSTARTS[0], tmp_path), "--model.init_args.ttt_lenght=3"])


def test_a_scheduler_without_an_optimizer_is_refused(tmp_path):
    args = [*short_fit(QUICKSTARTS[0], tmp_path), "--lr_scheduler=torch.optim.lr_scheduler.ConstantLR"]
    with pytest.raises(ValueError, match="'torch.optim.lr_scheduler.ConstantLR' is set without an optimizer"):
        run_cli(args)


# (learning_rate, warmup_ratio) each family documents as its default.
FAMILY_DEFAULTS = {
    "lightning_drafts.Eagle3Module": (1e-4, 0.05),
    "lightning_drafts.MLAEagle3Module": (1e-4, 0.05),
    "lightning_drafts.DFlashModule": (6e-4, 0.04),
    "lightning_drafts.DFlash2Module": (6e-4, 0.04),
    "lightning_drafts.DSparkModule": (6e-4, 0.05),
}


@pytest.mark.parametrize("config", QUICKSTARTS, ids=lambda p: p.stem)
def test_a_config_without_a_learning_rate_gets_the_family_default(config, tmp_path, capsys):
    data = yaml.safe_load(config.read_text())
    for key in ("learning_rate", "warmup_ratio"):
        data["model"]["init_args"].pop(key, None)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(SystemExit):
        run_cli(["fit", f"--config={path}", "--print_config"])
    resolved = yaml.safe_load(capsys.readouterr().out)["model"]["init_args"]
    expected = FAMILY_DEFAULTS[data["model"]["class_path"]]
    assert (resolved["learning_rate"], resolved["warmup_ratio"]) == pytest.approx(expected)


@pytest.mark.parametrize("config", RECIPES + REAL, ids=lambda p: f"{p.parent.name}-{p.stem}")
def test_gpu_recipe_parses(config, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_cli(["fit", f"--config={config}", "--print_config"])
    assert exit_info.value.code in (0, None)
    assert "class_path" in capsys.readouterr().out


def test_validate_subcommand_and_an_optimizer_chosen_in_yaml(tmp_path):
    eagle3 = ROOT / "configs" / "quickstart" / "eagle3.yaml"
    args = short_fit(eagle3, tmp_path)
    cli = run_cli(
        [
            *args,
            "--trainer.max_steps=2",
            "--optimizer=torch.optim.SGD",
            "--optimizer.lr=0.05",
            "--optimizer.momentum=0.9",
        ]
    )
    (optimizer,) = cli.trainer.optimizers
    assert isinstance(optimizer, torch.optim.SGD) and optimizer.defaults["momentum"] == 0.9

    (checkpoint,) = Path(cli.trainer.logger.log_dir, "checkpoints").glob("best*.ckpt")
    validated = run_cli(["validate", *args[1:], f"--ckpt_path={checkpoint}"])
    assert validated.trainer.state.fn == "validate"
    assert float(validated.trainer.callback_metrics["val/accept_len"]) >= 1.0


@pytest.mark.parametrize(
    ("old", "where"),
    [
        ("datamodules.PackedChatDataModule", "data"),
        ("callbacks.ThroughputCallback", "callback"),
    ],
)
def test_a_config_with_an_old_top_level_class_path_names_the_new_one(old, where, tmp_path):
    data = yaml.safe_load(QUICKSTARTS[0].read_text())
    if where == "data":
        data["data"]["class_path"] = old
    else:
        data["trainer"]["callbacks"][0]["class_path"] = old
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match=f"names '{old}'.*write 'lightning_drafts.{old}'"):
        run_cli(["fit", f"--config={path}", "--print_config"])
    with pytest.raises(ValueError, match=f"write 'lightning_drafts.{old}'"):
        run_cli(["fit", f"--config={QUICKSTARTS[0]}", f"--data={old}"])


@pytest.mark.parametrize(
    ("mask_token_id", "match"),
    [
        (500, r"mask_token_id = 500 is token '.*', which occurs [\d,]+ times in the data"),
        (2, r"mask_token_id = 2.*eos"),
    ],
)
def test_a_mask_token_the_data_uses_is_refused_at_fit_start(mask_token_id, match, tmp_path):
    dflash = ROOT / "configs" / "quickstart" / "dflash.yaml"
    with pytest.raises(ValueError, match=match):
        run_cli([*short_fit(dflash, tmp_path), f"--model.init_args.mask_token_id={mask_token_id}"])


@pytest.mark.parametrize("config", QUICKSTARTS + RECIPES + REAL, ids=lambda p: f"{p.parent.name}-{p.stem}")
def test_every_shipped_config_keeps_last_ckpt_after_every_validation(config):
    callbacks = yaml.safe_load(config.read_text())["trainer"]["callbacks"]
    keeps_last = [
        c.get("init_args", {})
        for c in callbacks
        if c["class_path"] == "lightning.pytorch.callbacks.ModelCheckpoint"
        and c.get("init_args", {}).get("filename") == "last"
    ]
    # Unmonitored (so written at every validation, not only on an improvement) and one file, not last-v1.
    assert keeps_last and all(
        a.get("monitor") is None and a.get("enable_version_counter") is False for a in keeps_last
    )
