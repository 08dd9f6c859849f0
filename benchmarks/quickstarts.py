"""Run every quickstart as a newcomer would (fit, export, evaluate) and report what it learned.

For each ``configs/quickstart/<name>.yaml``: ``lightning-drafts fit`` (wall and CPU time), export of its
``best.ckpt``, then ``lightning-drafts evaluate`` on 16 held-out prompts of the config's validation
split, 64 new tokens each past EOS (the shipped targets end a chat reply after about 16 tokens, and 16
short replies make a noisy figure), and on the 80 MT-Bench questions (both turns, the second after the
target's own first answer; up to 128 new tokens, stopping at the end of the target's turn as an engine
does). Prints two markdown tables: the served ``accept_len`` and the first / last ``val/loss`` and
``val/accept_len`` from the TensorBoard event file; MT-Bench's acceptance per category.

    .venv/bin/python benchmarks/quickstarts.py                     # all five, into runs-quickstarts/
    .venv/bin/python benchmarks/quickstarts.py --only eagle3 dspark --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_drafts.serving.served_table import ALL_CATEGORIES

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "lightning_drafts"]


def run(args: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Run a command; its wall time and the CPU time (user + system) of the process tree."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(args, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def scalars(log_dir: Path, tag: str) -> list[float]:
    events = EventAccumulator(str(log_dir))
    events.Reload()
    return [event.value for event in events.Scalars(tag)] if tag in events.Tags()["scalars"] else []


def quickstart(name: str, out: Path, env: dict[str, str]) -> dict:
    config = ROOT / "configs" / "quickstart" / f"{name}.yaml"
    fit_wall, fit_cpu = run(
        [*CLI, "fit", f"--config={config}", f"--trainer.logger.init_args.save_dir={out}"], env
    )
    log_dir = out / name / "version_0"
    export = out / f"{name}-export"
    run([*CLI, "export", str(log_dir / "checkpoints" / "best.ckpt"), str(export), "--overwrite"], env)
    report = out / f"{name}-served.json"
    evaluate = [*CLI, "evaluate", str(export), f"--config={config}"]
    eval_wall, _ = run(
        [*evaluate, "--num-prompts=16", "--max-new-tokens=64", "--ignore-eos", f"--json={report}"], env
    )
    served = json.loads(report.read_text())
    mt_bench = out / f"{name}-mt-bench.json"
    mt_bench_wall, _ = run(
        [
            *evaluate,
            "--prompts=mt-bench",
            "--max-new-tokens=128",
            "--no-training-estimate",
            "--no-card",
            f"--json={mt_bench}",
        ],
        env,
    )
    val_loss, val_accept = scalars(log_dir, "val/loss"), scalars(log_dir, "val/accept_len")
    return {
        "name": name,
        "fit_wall_s": round(fit_wall, 1),
        "fit_cpu_s": round(fit_cpu, 1),
        "evaluate_wall_s": round(eval_wall, 1),
        "served_accept_len": served["served"]["accept_len"],
        "rounds": served["rounds"],
        "val_loss": [round(val_loss[0], 3), round(val_loss[-1], 3)],
        "val_accept_len": [round(val_accept[0], 3), round(val_accept[-1], 3)],
        "mt_bench_wall_s": round(mt_bench_wall, 1),
        "mt_bench": json.loads(mt_bench.read_text())["table"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    names = sorted(p.stem for p in (ROOT / "configs" / "quickstart").glob("*.yaml"))
    parser.add_argument("--only", nargs="+", choices=names, default=names)
    parser.add_argument("--output", type=Path, default=ROOT / "runs-quickstarts")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of every run")
    args = parser.parse_args()
    env = dict(os.environ)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    rows = []
    for name in args.only:
        shutil.rmtree(args.output / name, ignore_errors=True)
        rows.append(quickstart(name, args.output, env))
        print(json.dumps(rows[-1]), flush=True)
    print(
        "\n| quickstart | fit wall / CPU (s) | served accept_len | val/loss first -> last | val/accept_len first -> last |"
    )
    print("|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['name']} | {row['fit_wall_s']} / {row['fit_cpu_s']} | {row['served_accept_len']:.3f} "
            f"({row['rounds']} rounds) | {row['val_loss'][0]} -> {row['val_loss'][1]} | "
            f"{row['val_accept_len'][0]} -> {row['val_accept_len'][1]} |"
        )
    print(mt_bench_table(rows))


def mt_bench_table(rows: list[dict]) -> str:
    """Each quickstart's MT-Bench acceptance: pooled (per-request) for every category and the whole set,
    then tokens/s of the built-in decode with the draft and with the target alone."""
    categories = [r["category"] for r in rows[0]["mt_bench"]]
    lines = [
        "| quickstart | " + " | ".join(categories) + " | tokens/s with / without draft |",
        "|---|" + "---|" * (len(categories) + 1),
    ]
    for row in rows:
        cells = {r["category"]: r for r in row["mt_bench"]}
        speeds = cells[ALL_CATEGORIES]["tokens_per_s"]
        lines.append(
            f"| {row['name']} | "
            + " | ".join(
                f"{cells[c]['accept_len_pooled']:.2f} ({cells[c]['accept_len_per_request']:.2f})"
                for c in categories
            )
            + f" | {speeds['draft']:.0f} / {speeds['target']:.0f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
