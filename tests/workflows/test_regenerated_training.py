"""Training on the target's own answers pays when served, shortened: on the shipped target, a draft trained on the target's regenerated
answers accepts more tokens when served than one trained on the original answers, same steps and seed.

The full-size run is ``benchmarks/regenerated_accept.py`` (docs: Results, regenerated data); here
40 conversations cut at 256 tokens and 50 steps, served on 8 prompts of 10 conversations neither draft
trained on.
"""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path

from lightning_drafts.cli.main import main as cli_main
from lightning_drafts.cli.main import run_cli
from lightning_drafts.datamodules.embedded import embedded_corpus_rows

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "quickstart" / "eagle3.yaml"


def write(rows: list[dict], path: Path) -> Path:
    path.write_text("".join(json.dumps({"messages": row["messages"]}) + "\n" for row in rows))
    return path


def test_a_draft_trained_on_regenerated_answers_accepts_more_when_served(tmp_path: Path) -> None:
    rows = list(islice(embedded_corpus_rows(), 50))
    original, heldout = (
        write(rows[:40], tmp_path / "original.jsonl"),
        write(rows[40:], tmp_path / "heldout.jsonl"),
    )
    data = [
        "--data.init_args.max_tokens=256",  # half the quickstart's rows: regenerate and fit cost half
        "--data.init_args.val_fraction=0",
        f"--data.init_args.val_data_files={heldout}",
        f"--data.init_args.cache_dir={tmp_path / 'cache'}",
    ]
    regenerated = tmp_path / "regenerated.jsonl"
    cli_main(
        ["regenerate", f"--config={CONFIG}", f"--data.init_args.data_files={original}", *data]
        + [f"--output={regenerated}", "--max-new-tokens=32", "--batch-size=40"]
    )
    served = {}
    for name, answers in (("original", original), ("regenerated", regenerated)):
        cli = run_cli(
            ["fit", f"--config={CONFIG}", f"--data.init_args.data_files={answers}", *data]
            + [
                "--trainer.max_steps=50",
                "--trainer.limit_val_batches=2",
                "--trainer.enable_progress_bar=false",
            ]
            + [
                f"--trainer.logger.init_args.save_dir={tmp_path / 'runs'}",
                f"--trainer.logger.init_args.name={name}",
            ]
        )
        export = tmp_path / f"{name}-export"
        cli_main(["export", cli.trainer.checkpoint_callback.best_model_path, str(export)])
        report = tmp_path / f"{name}.json"
        # Both are served on the same held-out prompts (the original config's validation conversations).
        cli_main(
            ["evaluate", str(export), f"--config={CONFIG}", f"--data.init_args.data_files={original}", *data]
            + ["--num-prompts=8", "--max-new-tokens=64", "--ignore-eos", "--no-training-estimate"]
            + [f"--json={report}"]
        )
        served[name] = json.loads(report.read_text())["served"]["accept_len"]
    assert served["regenerated"] > served["original"] + 0.15, served
