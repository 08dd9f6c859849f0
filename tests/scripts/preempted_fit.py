"""A tiny fit of one family (eagle3, dflash, dflash2, dspark) through `lightning-drafts fit` on 1 or 2 CPU
processes (gloo DDP), recorded step by step (tests/support/step_recorder.py), for the preemption and resume tests.

Usage: preempted_fit.py OUT_DIR FAMILY LAUNCH DEVICES MAX_STEPS [HOLD_AT_STEP UNTIL] [-- EXTRA FIT ARGS]

The family's quickstart config: its callbacks and checkpoint policy (best.ckpt + last.ckpt at every
validation), its shipped tiny target and tokenizer, its draft; shrunk data, rows and run length; validation
every 2 steps. The block drafts draw their anchors (and DFlash its variable prefixes) every step.
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

from lightning_drafts.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


def config(out: Path, family: str, launch: str, devices: int, max_steps: int, hold: int, until: str) -> dict:
    config = yaml.safe_load((ROOT / "configs" / "quickstart" / f"{family}.yaml").read_text())
    config["data"]["init_args"].update(
        max_tokens=96, batch_size=2, val_fraction=0.1, max_documents=60, cache_dir=str(out / "cache")
    )
    config["data"]["init_args"]["setup_summary"] = False
    config["trainer"].update(
        devices=devices,
        max_steps=max_steps,
        val_check_interval=2,
        limit_val_batches=1,
        log_every_n_steps=1,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    if devices > 1:
        config["trainer"]["strategy"] = {
            "class_path": "lightning.pytorch.strategies.DDPStrategy",
            "init_args": {"process_group_backend": "gloo"},
        }
    config["trainer"]["logger"]["init_args"]["save_dir"] = str(out / "runs")
    callbacks = [
        c for c in config["trainer"]["callbacks"] if not c["class_path"].endswith("DataMatchCallback")
    ]
    callbacks.append(
        {"class_path": "lightning_drafts.callbacks.DataMatchCallback", "init_args": {"num_documents": 0}}
    )
    callbacks.append(
        {
            "class_path": "tests.support.step_recorder.StepRecorder",
            "init_args": {"out": str(out), "launch": launch, "hold_at_step": hold, "until": until},
        }
    )
    config["trainer"]["callbacks"] = callbacks
    if family == "eagle3":
        config["model"]["init_args"].update(draft_vocab_size=256)
    if family != "eagle3":
        # Fewer anchors per document than its candidates: which ones is a random draw every step.
        config["model"]["init_args"].update(num_anchors=2)
    if family == "dflash":
        # A second random draw per block, from the same generator as the anchors.
        config["model"]["init_args"].update(variable_prefix=True)
    return config


if __name__ == "__main__":
    args, extra = sys.argv[1:], []
    if "--" in args:
        args, extra = args[: args.index("--")], args[args.index("--") + 1 :]
    out, family, launch, devices, max_steps = Path(args[0]), args[1], args[2], int(args[3]), int(args[4])
    hold, until = (int(args[5]), args[6]) if len(args) > 5 else (0, "signal")
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"config-{launch}.yaml"
    path.write_text(yaml.safe_dump(config(out, family, launch, devices, max_steps, hold, until)))
    main(["fit", f"--config={path}", *extra])
