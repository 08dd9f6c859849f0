"""Does training on the target's own answers pay when served?

Two EAGLE-3 drafts of the shipped ``tiny-llama`` target, trained by the quickstart config with the same
steps, seed and held-out validation conversations, differ only in their training answers:

* ``original``: the first ``--train`` conversations of the embedded corpus as they are;
* ``regenerated``: the same conversations after ``lightning-drafts regenerate`` (greedy, every assistant
  turn rewritten by the target, turn by turn).

Both are exported and served by ``lightning-drafts evaluate`` on the same prompts, taken from the next
``--heldout`` conversations (neither draft trained on them), 64 new tokens each past EOS. Prints a markdown
table: the data match of each training set (``regenerate --check``), the last ``val/accept_len`` and the
served ``accept_len``.

    .venv/bin/python benchmarks/regenerated_accept.py                       # into runs-regenerated/
    .venv/bin/python benchmarks/regenerated_accept.py --train 400 --steps 100 --engine transformers
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from itertools import islice
from pathlib import Path

from quickstarts import CLI, ROOT, run, scalars

from lightning_drafts.datamodules.embedded import embedded_corpus_rows

QUICKSTART = ROOT / "configs" / "quickstart" / "eagle3.yaml"


def write_rows(rows: list[dict], path: Path) -> None:
    with path.open("w", encoding="utf-8") as out:
        for row in rows:
            out.write(json.dumps({"messages": row["messages"]}, ensure_ascii=False) + "\n")


def data_overrides(train: Path, heldout: Path, out: Path) -> list[str]:
    """The quickstart config's data, trained on ``train`` and validated on ``heldout`` (fit's dotted
    overrides, which ``regenerate`` and ``evaluate`` take too)."""
    return [
        f"--data.init_args.data_files={train}",
        "--data.init_args.val_fraction=0",
        f"--data.init_args.val_data_files={heldout}",
        f"--data.init_args.cache_dir={out / 'cache'}",
    ]


def data_match(data: list[str], env: dict[str, str], documents: int) -> float:
    done = subprocess.run(
        [*CLI, "regenerate", f"--config={QUICKSTART}", *data, f"--check={documents}"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return float(re.search(r"data match: ([\d.]+)%", done.stdout).group(1)) / 100


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "runs-regenerated")
    parser.add_argument("--train", type=int, default=2000, help="training conversations")
    parser.add_argument("--heldout", type=int, default=200, help="validation / prompt conversations")
    parser.add_argument("--steps", type=int, default=700)
    parser.add_argument("--engine", choices=["vllm", "transformers"], default="vllm")
    parser.add_argument("--batch-size", type=int, default=256, help="conversations regenerated together")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="per regenerated turn")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}

    rows = list(islice(embedded_corpus_rows(), args.train + args.heldout))
    original, heldout = args.out / "original.jsonl", args.out / "heldout.jsonl"
    write_rows(rows[: args.train], original)
    write_rows(rows[args.train :], heldout)
    data = {"original": data_overrides(original, heldout, args.out)}
    regenerated = args.out / "regenerated.jsonl"
    start = time.perf_counter()
    run(
        [
            *CLI,
            "regenerate",
            f"--config={QUICKSTART}",
            *data["original"],
            f"--output={regenerated}",
            f"--engine={args.engine}",
            f"--batch-size={args.batch_size}",
            f"--max-new-tokens={args.max_new_tokens}",
            "--overwrite",
        ],
        env,
    )
    regenerate_wall = time.perf_counter() - start
    counts = json.loads(Path(f"{regenerated}.meta.json").read_text())["counts"]
    data["regenerated"] = data_overrides(regenerated, heldout, args.out)

    results = []
    for name, overrides in data.items():
        match = data_match(overrides, env, documents=64)
        shutil.rmtree(args.out / name, ignore_errors=True)  # so the run is version_0
        trainer = [
            f"--trainer.max_steps={args.steps}",
            "--trainer.enable_progress_bar=false",
            f"--trainer.logger.init_args.save_dir={args.out}",
            f"--trainer.logger.init_args.name={name}",
        ]
        fit_wall, _ = run([*CLI, "fit", f"--config={QUICKSTART}", *overrides, *trainer], env)
        log_dir = args.out / name / "version_0"
        export = args.out / f"{name}-export"
        run([*CLI, "export", str(log_dir / "checkpoints" / "best.ckpt"), str(export), "--overwrite"], env)
        report = args.out / f"{name}-served.json"
        run(
            [
                *CLI,
                "evaluate",
                str(export),
                # Both drafts are served on the same prompts: the held-out conversations.
                f"--config={QUICKSTART}",
                *data["original"],
                f"--num-prompts={args.num_prompts}",
                "--max-new-tokens=64",
                "--ignore-eos",
                f"--json={report}",
            ],
            env,
        )
        served = json.loads(report.read_text())
        results.append(
            {
                "name": name,
                "data_match": match,
                "fit_wall_s": round(fit_wall, 1),
                "val_accept_len": round(scalars(log_dir, "val/accept_len")[-1], 3),
                "served_accept_len": served["served"]["accept_len"],
                "rounds": served["rounds"],
            }
        )
    summary = {
        "regenerate": {"engine": args.engine, "wall_s": round(regenerate_wall, 1), **counts},
        "results": results,
    }
    summary["regenerate"].pop("skipped_rows", None)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary["regenerate"]))
    print("| training answers | data match | last val/accept_len | served accept_len (rounds) |")
    print("|---|---|---|---|")
    for r in results:
        print(
            f"| {r['name']} | {r['data_match']:.1%} | {r['val_accept_len']:.3f} | "
            f"{r['served_accept_len']:.3f} ({r['rounds']}) |"
        )


if __name__ == "__main__":
    sys.exit(main())
