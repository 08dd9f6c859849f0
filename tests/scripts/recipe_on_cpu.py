"""Run GPU recipes through `lightning-drafts fit` on 2 CPU processes, shrunk only where hardware forces it.

Usage: recipe_on_cpu.py OUT_DIR RECIPE [RECIPE ...]   (each runs in OUT_DIR/<recipe stem>)

Kept from the recipe: the strategy (FSDP2 ``ModelParallelStrategy``), the precision (``bf16-mixed``), the draft's
hyperparameters, the callbacks and checkpoint policy. Replaced: the target and the size-bound fields
that follow it (from the quickstart config of the same draft: a shipped tiny target, its mask id, layer
ids and draft vocabulary), the data (the embedded corpus, with the quickstart's tokenizer), the
accelerator and the run length.
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from lightning_drafts.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
SIZE_BOUND = ("target", "target_layer_ids", "mask_token_id", "draft_vocab_size")


def quickstart_of(model_class: str) -> dict:
    for path in sorted((ROOT / "configs" / "quickstart").glob("*.yaml")):
        config = yaml.safe_load(path.read_text())
        if config["model"]["class_path"] == model_class:
            return config
    raise ValueError(f"no quickstart config trains {model_class}")


def shrunk(recipe: Path, out: Path) -> dict:
    config = yaml.safe_load(recipe.read_text())
    model = config["model"]["init_args"]
    quickstart = quickstart_of(config["model"]["class_path"])
    quick = quickstart["model"]["init_args"]
    for key in SIZE_BOUND:
        model.pop(key, None)
        if key in quick:
            model[key] = quick[key]
    config["data"]["init_args"] = {
        "tokenizer": quickstart["data"]["init_args"].get("tokenizer"),
        "max_tokens": 256,
        "batch_size": 2,
        "val_fraction": 0.1,
        "max_documents": 64,
        "cache_dir": str(out / "cache"),
    }
    config["trainer"].update(
        accelerator="cpu",
        devices=2,
        max_steps=2,
        val_check_interval=1,
        limit_val_batches=1,
        log_every_n_steps=1,
        accumulate_grad_batches=1,
    )
    config["trainer"]["logger"]["init_args"]["save_dir"] = str(out / "runs")
    config["trainer"]["strategy"]["init_args"]["process_group_backend"] = "gloo"
    return config


def fit(recipe: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    config = out / "config.yaml"
    config.write_text(yaml.safe_dump(shrunk(recipe, out)))
    main(["fit", f"--config={config}"])


if __name__ == "__main__":
    for recipe in sys.argv[2:]:
        fit(Path(recipe), Path(sys.argv[1]) / Path(recipe).stem)
