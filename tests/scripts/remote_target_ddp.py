"""Two trainer ranks (DDP on gloo), each with its own target worker on one Ray cluster
(tests/training/test_remote_target.py).

``python remote_target_ddp.py CONFIG OUT``: the co-located 2-rank run, then the same run whose ranks join
the Ray cluster this script started (``target_address``) with one worker each. Every rank must train on
exactly its own units (its rank, every step once) and get the co-located rank's per-step losses; the
final drafts must be equal. Prints ``OK <what>``; any failure exits non-zero.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import lightning as L
import ray
import torch

from lightning_drafts.cli.fit import build_from_config
from lightning_drafts.core.digest import state_digest
from lightning_drafts.training.remote_target import start_local_ray

STEPS = 3
DATA = [
    "--data.init_args.max_documents=24",
    "--data.init_args.max_tokens=96",
    "--data.init_args.batch_size=2",
    "--data.init_args.val_fraction=0",
    "--data.init_args.setup_summary=false",
]


class Record(L.Callback):
    """Each rank writes its per-step losses, the units it trained on and the final draft digest."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer, pl_module) -> None:
        remote = pl_module.remote_target
        units = [] if remote is None else [vars(u) for u in sorted(remote.ledger.consumed)]
        record = {
            "losses": self.losses,
            "units": units,
            "digest": state_digest(pl_module.draft_state_dict()),
        }
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def run(config: str, out: Path, *overrides: str) -> list[dict]:
    out.mkdir(parents=True)
    L.seed_everything(0, verbose=False)
    model, data = build_from_config(["--config", config, *DATA, *overrides])
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_spawn",
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[Record(out)],
    )
    trainer.fit(model, datamodule=data)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def main() -> None:
    torch.set_num_threads(1)
    config, out = sys.argv[1], Path(sys.argv[2])
    start = time.monotonic()
    start_local_ray(2)
    address = ray.get_runtime_context().gcs_address
    reference = run(config, out / "co-located")
    remote = run(
        config,
        out / "remote",
        "--model.init_args.target_workers=1",
        f"--model.init_args.target_address={address}",
    )
    for rank in range(2):
        expected = [{"split": "train", "epoch": 0, "step": s, "rank": rank, "micro": 0} for s in range(STEPS)]
        assert remote[rank]["units"] == expected, (rank, remote[rank]["units"])
        assert remote[rank]["losses"] == reference[rank]["losses"], (rank, remote, reference)
        assert remote[rank]["digest"] == reference[rank]["digest"], (rank, remote, reference)
    assert reference[0]["losses"] != reference[1]["losses"], reference
    print(
        f"[{time.monotonic() - start:.0f} s] OK two ranks each trained on their own units exactly", flush=True
    )
    ray.shutdown()


if __name__ == "__main__":
    main()
