"""configs/real (SmolLM2-135M-Instruct as GGUF) run as a user runs them, with the tiny GGUF of the same
depth and head layout in place of the real file and a small ShareGPT file as the data: each fits through
the CLI with no warning that SGLang would not serve its layers, exports, and the export validates against
the GGUF target, with a model card that records the target as given and serves its converted folder."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import yaml

from lightning_drafts.cli.main import main, run_cli
from lightning_drafts.datamodules.embedded import embedded_corpus_rows
from lightning_drafts.workflows.export import validate_export
from tests.families.family_case import ROOT

REAL = sorted((ROOT / "configs" / "real").glob("*.yaml"))
SHAREGPT_ROLES = {"user": "human", "assistant": "gpt", "system": "system"}


def sharegpt_file(path: Path, count: int = 120) -> Path:
    """``count`` conversations of the embedded corpus in ShareGPT form (what the configs' data files are)."""
    with path.open("w") as out:
        for index, row in enumerate(embedded_corpus_rows()):
            if index == count:
                break
            turns = [{"from": SHAREGPT_ROLES[m["role"]], "value": m["content"]} for m in row["messages"]]
            out.write(json.dumps({"conversations": turns}) + "\n")
    return path


def test_the_real_configs_are_the_four_block_and_eagle_families():
    classes = {yaml.safe_load(p.read_text())["model"]["class_path"] for p in REAL}
    assert classes == {
        f"lightning_drafts.{c}" for c in ("Eagle3Module", "DFlashModule", "DFlash2Module", "DSparkModule")
    }
    for config in REAL:
        data = yaml.safe_load(config.read_text())
        assert data["model"]["init_args"]["target"] == data["data"]["init_args"]["tokenizer"]
        assert data["model"]["init_args"]["target"].endswith(".gguf")


@pytest.mark.parametrize("config", REAL, ids=lambda p: p.stem)
def test_a_real_config_fits_exports_and_validates_on_a_gguf_target(config, tiny_gguf, tmp_path):
    gguf_path, _ = tiny_gguf
    data = sharegpt_file(tmp_path / "train.jsonl")
    args = [
        "fit",
        f"--config={config}",
        f"--model.init_args.target={gguf_path}",
        f"--data.init_args.tokenizer={gguf_path}",
        f"--data.init_args.data_files={data}",
        # The tiny target's vocabulary is 2,048 ids; the EAGLE-3 config's draft vocabulary is SmolLM2-sized.
        *(["--model.init_args.draft_vocab_size=1024"] if "draft_vocab_size" in config.read_text() else []),
        "--data.init_args.max_tokens=128",
        "--trainer.accelerator=cpu",
        # Few target forwards: each runs all 30 layers (the data match is tested on the shipped targets).
        "--trainer.num_sanity_val_steps=0",
        '--trainer.callbacks+={"class_path": "lightning_drafts.callbacks.DataMatchCallback", '
        '"init_args": {"num_documents": 0}}',
        "--trainer.max_steps=2",
        "--trainer.val_check_interval=2",
        "--trainer.limit_val_batches=1",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        f"--data.init_args.cache_dir={tmp_path / 'cache'}",
    ]
    with warnings.catch_warnings():
        # The defaults must be servable: a layer SGLang does not capture warns, and fails here.
        warnings.filterwarnings("error", message=".*standard SGLang captures.*")
        cli = run_cli(args)
    assert cli.trainer.global_step == 2
    checkpoint = Path(cli.trainer.logger.log_dir, "checkpoints", "last.ckpt")
    export = tmp_path / "export"
    main(["export", str(checkpoint), str(export)])
    summary = validate_export(export, cli.model.target)
    assert summary is not None
    card = (export / "README.md").read_text()
    # The serve commands name the converted folder by its name: no path of this machine.
    folder = gguf_path.name[: -len(".gguf")] + "-hf"
    assert "base_model" not in card and str(gguf_path.parent) not in card and f"`{gguf_path.name}`" in card
    assert f"serve {folder} " in card and f"convert-gguf {gguf_path.name} {folder}" in card
