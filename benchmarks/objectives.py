"""A short CPU run of every objective from the quickstart configs: does the loss fall, does val/accept_len rise?

Each run is the quickstart config (random tiny target, embedded corpus) with one objective option
overridden, seed 0, validated once before training and every ``--val-every`` steps. Prints a markdown
table: the mean train loss of the first and of the last ``--window`` steps (loss scales differ between
objectives: D-PACE sums weights per block, lk-tv is a probability), val/accept_len before training and
at the end, and, for the block drafts, NeMo's val/accept_len_skip_holes at the end.

    .venv/bin/python benchmarks/objectives.py                       # every objective, 40 steps each
    .venv/bin/python benchmarks/objectives.py --runs dflash:dpace eagle3:lambda --steps 60
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
from lightning_drafts.datamodules import PackedChatDataModule

from lightning_drafts.cli.main import DraftCLI
from lightning_drafts.dflash.objectives import LOSS_TYPES
from lightning_drafts.eagle3.step_objective import LK_LOSS_TYPES
from lightning_drafts.training.module import DraftModule

QUICKSTART = Path(__file__).resolve().parents[1] / "configs" / "quickstart"
OPTION = {
    "dflash": "loss_type",
    "dflash2": "loss_type",
    "eagle3": "lk_loss_type",
    "mla_eagle3": "lk_loss_type",
}
VALUES = {
    "dflash": LOSS_TYPES,
    "dflash2": LOSS_TYPES,
    "eagle3": tuple("null" if v is None else v for v in LK_LOSS_TYPES),
    "mla_eagle3": tuple("null" if v is None else v for v in LK_LOSS_TYPES),
}


class Record(L.Callback):
    """The per-step train loss and the metrics of every validation."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.validations: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_validation_end(self, trainer, module) -> None:
        if not trainer.sanity_checking:
            metrics = trainer.callback_metrics
            self.validations.append({k: float(v) for k, v in metrics.items() if k.startswith("val/")})


def run(config: str, value: str, steps: int, val_every: int, val_batches: int, out: Path) -> dict:
    record = Record()
    cli = DraftCLI(
        DraftModule,
        PackedChatDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        args=[
            f"--config={QUICKSTART / f'{config}.yaml'}",
            f"--model.init_args.{OPTION[config]}={value}",
            f"--trainer.max_steps={steps}",
            f"--trainer.val_check_interval={val_every}",
            f"--trainer.limit_val_batches={val_batches}",
            "--trainer.num_sanity_val_steps=0",
            "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false",
            "--trainer.logger=false",
            "--trainer.callbacks=[]",
            "--trainer.enable_checkpointing=false",
            f"--data.init_args.cache_dir={out / 'cache'}",
        ],
        run=False,
        save_config_callback=None,
    )
    cli.trainer.callbacks.append(record)
    start = time.perf_counter()
    cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return {"record": record, "seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--runs", nargs="*", help="config:value pairs (default: every objective of every config)"
    )
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--val-every", type=int, default=20)
    parser.add_argument("--val-batches", type=int, default=4)
    parser.add_argument("--window", type=int, default=5)
    args = parser.parse_args()
    runs = (
        [tuple(r.split(":", 1)) for r in args.runs]
        if args.runs
        else [(config, value) for config, values in VALUES.items() for value in values]
    )
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(
        f"{args.steps} steps, validation before training and every {args.val_every} steps "
        f"({args.val_batches} batches); loss = mean of the first / last {args.window} steps\n"
    )
    print(
        "| config | objective | loss first | loss last | val/accept_len before | val/accept_len end "
        "| val/accept_len_skip_holes end | s |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for config, value in runs:
            result = run(config, value, args.steps, args.val_every, args.val_batches, Path(tmp))
            record = result["record"]
            first = sum(record.losses[: args.window]) / args.window
            last = sum(record.losses[-args.window :]) / args.window
            before, end = record.validations[0], record.validations[-1]
            skip = end.get("val/accept_len_skip_holes")
            skip_text = "" if skip is None else f"{skip:.3f}"
            print(
                f"| {config} | {value} | {first:.3f} | {last:.3f} | {before['val/accept_len']:.3f} "
                f"| {end['val/accept_len']:.3f} | {skip_text} | {result['seconds']:.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
