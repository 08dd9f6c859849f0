"""The table of ``benchmarks/features_accept.sh``: per storage dtype, ``val/accept_len`` and ``val/loss`` at
each validation step of every seed's run, and their mean and spread across seeds (sample standard
deviation, min-max), read back from the runs' TensorBoard events.

    .venv/bin/python benchmarks/features_accept_summary.py runs-features-accept
"""

from __future__ import annotations

import argparse
import re
import statistics
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

TAGS = ("val/accept_len", "val/loss")


def read_run(directory: Path) -> dict[str, dict[int, float]] | None:
    """``tag -> {step: value}`` of the run's last version (``None`` before its first validation)."""
    version = sorted(directory.glob("*/version_*"), key=lambda p: int(p.name.split("_")[1]))[-1]
    events = EventAccumulator(str(version))
    events.Reload()
    if not all(tag in events.Tags()["scalars"] for tag in TAGS):
        return None
    return {tag: {event.step: event.value for event in events.Scalars(tag)} for tag in TAGS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the OUT directory of features_accept.sh")
    args = parser.parse_args()
    runs: dict[str, dict[int, dict]] = {}
    for directory in sorted(args.out.glob("runs-*-seed*")):
        dtype, seed = re.fullmatch(r"runs-(.+)-seed(\d+)", directory.name).groups()
        run = read_run(directory)
        if run is None:
            print(f"{directory}: no validation logged yet, left out")
            continue
        runs.setdefault(dtype, {})[int(seed)] = run
    for dtype, seeds in runs.items():
        steps = sorted(set.intersection(*(set(run["val/accept_len"]) for run in seeds.values())))
        print(f"\n{dtype}: seeds {sorted(seeds)}")
        print("| seed | " + " | ".join(f"{tag} at step {s}" for tag in TAGS for s in steps) + " |")
        print("|---|" + "---:|" * (len(TAGS) * len(steps)))
        for seed, run in sorted(seeds.items()):
            print(f"| {seed} | " + " | ".join(f"{run[tag][s]:.4f}" for tag in TAGS for s in steps) + " |")
        cells = []
        for tag in TAGS:
            for s in steps:
                values = [run[tag][s] for run in seeds.values()]
                spread = statistics.stdev(values) if len(values) > 1 else float("nan")
                cells.append(
                    f"{statistics.mean(values):.4f} ± {spread:.4f} ({min(values):.4f}-{max(values):.4f})"
                )
        print("| mean ± sd (min-max) | " + " | ".join(cells) + " |")
    paired(runs)


def paired(runs: dict[str, dict[int, dict]]) -> None:
    """Each other dtype minus the first, seed by seed (the same seed draws the same initial draft, so the
    pairs cancel part of the run-to-run noise)."""
    names = list(runs)
    for other in names[1:]:
        base, seeds = names[0], sorted(set(runs[names[0]]) & set(runs[other]))
        if len(seeds) < 2:
            continue
        print(f"\n{other} minus {base}, paired by seed ({len(seeds)} seeds): mean ± sd of the differences")
        for tag in TAGS:
            steps = sorted(set.intersection(*(set(runs[n][s][tag]) for n in (base, other) for s in seeds)))
            cells = []
            for step in steps:
                deltas = [runs[other][s][tag][step] - runs[base][s][tag][step] for s in seeds]
                cells.append(f"step {step}: {statistics.mean(deltas):+.4f} ± {statistics.stdev(deltas):.4f}")
            print(f"- {tag}: " + "; ".join(cells))


if __name__ == "__main__":
    main()
