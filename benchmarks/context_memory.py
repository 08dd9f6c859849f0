"""Peak memory and time of one packed training step of every draft against the row width (the context).

Each draft is its quickstart config (``configs/quickstart/<draft>.yaml``: the shipped tiny trained
target, the draft's own settings; ``--targets tiny``: the random tiny targets of ``benchmarks/tiny_targets.py``)
trained for one step on ONE packed row of ``--widths`` tokens (1k to 32k): documents of chat length
(64 to 768 tokens, uniform, seeded; 64 to 256 on the tiny targets), the first quarter of each
unsupervised (its prompt), the rest supervised. The step is the target forward, the draft, the loss,
its backward and one AdamW step (anchor drafts with anchors drawn by their own ``sample_anchors`` from a
fixed generator).

Every (draft, width) runs in a fresh subprocess (``benchmarks/context_step.py``, which the 32k-token
test runs too), so a point's peak is its own step's and not a leftover of an earlier one:

* CPU: the growth of the resident-set high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``
  just before the step, after ``malloc_trim`` returned freed heap) over the resident set at the start;
* CUDA (``--device cuda``): ``torch.cuda.max_memory_allocated`` above the allocation at the start.

Per draft the script prints the peak and step time at each width, the growth exponent between
consecutive widths (``log(peak ratio) / log(width ratio)``: 1 is linear, 2 quadratic), the
least-squares fit ``peak = a + b * T + c * T^2`` with the quadratic term's share of the peak at the
largest width, and a verdict. ``--profile`` adds, per draft, the operators that allocate the most at
the two largest widths (``torch.profiler`` with ``profile_memory``, self allocation of each operator
summed over its calls) and the growth exponent of each: an operator near 2 is a ``[T, T]`` term.

    .venv/bin/python benchmarks/context_memory.py                       # every draft, 1k .. 32k
    .venv/bin/python benchmarks/context_memory.py --drafts eagle3 --widths 2048 8192 --profile
    .venv/bin/python benchmarks/context_memory.py --device cuda
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
STEP_SCRIPT = ROOT / "benchmarks" / "context_step.py"
sys.path.insert(0, str(ROOT))

import context_step  # noqa: E402

DRAFTS = ("eagle3", "mla_eagle3", "dflash", "dflash2", "dspark")
WIDTHS = (1024, 2048, 4096, 8192, 16384, 32768)
MIB = 2**20
# A growth exponent between the two largest widths above this is called faster than linear: memory of a
# packed row also holds terms linear in the documents and the blocks, whose count moves with the row.
LINEAR_EXPONENT = 1.15


def profile_allocations(draft: str, width: int, targets: str, seed: int, threads: int) -> dict[str, int]:
    """Bytes each operator allocates itself during one step (``self_cpu_memory_usage`` also counts the
    frees inside the same operator, so it is what an operator leaves to later ones: masks, logits, saved
    activations), summed over its calls."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(threads)
    module, batch, anchors = context_step.prepared(draft, width, targets, seed, "cpu")
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-3)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        context_step.train_step(module, optimizer, batch, anchors)
    return {e.key: int(e.self_cpu_memory_usage) for e in prof.key_averages() if e.self_cpu_memory_usage > 0}


def run_child(command: list[str]) -> dict:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def fit(widths: list[int], peaks: list[float]) -> dict:
    """Growth exponents between consecutive widths and the least-squares ``a + b T + c T^2``."""
    exponents = [
        math.log(peaks[i + 1] / peaks[i]) / math.log(widths[i + 1] / widths[i])
        for i in range(len(widths) - 1)
        if peaks[i] > 0 and peaks[i + 1] > 0
    ]
    t = np.asarray(widths, dtype=float)
    design = np.stack([np.ones_like(t), t, t**2], axis=1)
    (a, b, c), *_ = np.linalg.lstsq(design, np.asarray(peaks, dtype=float), rcond=None)
    quadratic_share = c * t[-1] ** 2 / max(peaks[-1], 1.0)
    # The line alone, what the 32k-token test extends to its width.
    (line_a, line_b), *_ = np.linalg.lstsq(design[:, :2], np.asarray(peaks, dtype=float), rcond=None)
    return {
        "exponents": exponents,
        "a": a,
        "b": b,
        "c": c,
        "quadratic_share": quadratic_share,
        "line_a": line_a,
        "line_b": line_b,
    }


def report(draft: str, points: list[dict]) -> None:
    widths = [p["width"] for p in points]
    peaks = [p["peak_bytes"] for p in points]
    growth = fit(widths, peaks)
    print(f"\n### {draft}\n")
    print(
        "| row width | documents | peak MiB | MiB per 1k tokens | step s | step CPU s | exponent from previous | loss |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for i, p in enumerate(points):
        exponent = f"{growth['exponents'][i - 1]:.2f}" if i else ""
        print(
            f"| {p['width']:,} | {p['documents']} | {p['peak_bytes'] / MIB:,.0f} | "
            f"{p['peak_bytes'] / MIB / (p['width'] / 1024):.1f} | {p['seconds']:.2f} | {p['cpu_seconds']:.2f} | "
            f"{exponent} | {p['loss']:.4f} |"
        )
    last = growth["exponents"][-1] if growth["exponents"] else float("nan")
    verdict = "linear" if last <= LINEAR_EXPONENT else "FASTER THAN LINEAR"
    print(
        f"\nfit: peak = {growth['a'] / MIB:,.1f} MiB + {growth['b'] * 1024 / MIB:,.3f} MiB per 1k tokens * T"
        f" + {growth['c'] * 2**20 / MIB:,.4f} MiB per (1k tokens)^2 * T^2; the T^2 term is "
        f"{growth['quadratic_share']:.0%} of the peak at {widths[-1]:,}; exponent "
        f"{widths[-2]:,} -> {widths[-1]:,}: {last:.2f} ({verdict})"
    )
    print(
        f"line: peak = {growth['line_a'] / MIB:,.1f} MiB + {growth['line_b'] * 1024 / MIB:,.2f} MiB per 1k "
        f"tokens * T (at 32,768 tokens: {(growth['line_a'] + growth['line_b'] * 32768) / MIB:,.0f} MiB)"
    )


def report_profile(draft: str, widths: list[int], args: argparse.Namespace) -> None:
    small, large = widths[-2], widths[-1]
    low, high = (profile_allocations_child(draft, w, args) for w in (small, large))
    print(f"\nlargest self allocations of one {draft} step, {small:,} and {large:,} tokens:\n")
    print(f"| operator | MiB at {small:,} | MiB at {large:,} | exponent |")
    print("|---|---:|---:|---:|")
    for key in sorted(high, key=lambda k: -high[k])[: args.top]:
        exponent = (
            math.log(high[key] / low[key]) / math.log(large / small) if low.get(key, 0) > 0 else float("nan")
        )
        print(f"| `{key}` | {low.get(key, 0) / MIB:,.1f} | {high[key] / MIB:,.1f} | {exponent:.2f} |")


def point(draft: str, width: int, args: argparse.Namespace) -> dict:
    """One step in a fresh process (``benchmarks/context_step.py``)."""
    return run_child(
        [sys.executable, str(STEP_SCRIPT), draft, str(width), args.targets, "--device", args.device]
        + ["--threads", str(args.threads), "--seed", str(args.seed)]
    )


def profile_allocations_child(draft: str, width: int, args: argparse.Namespace) -> dict[str, int]:
    child = ["--child", draft, str(width), args.targets, str(args.seed), str(args.threads)]
    return run_child([sys.executable, __file__, *child])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafts", nargs="+", choices=DRAFTS, default=list(DRAFTS))
    parser.add_argument("--widths", nargs="+", type=int, default=list(WIDTHS))
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each step (CPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true", help="also list the operators that allocate most")
    parser.add_argument("--top", type=int, default=8, help="operators listed per draft under --profile")
    parser.add_argument("--json", type=Path, help="also write every point to this file")
    parser.add_argument(
        "--targets",
        choices=("shipped", "tiny"),
        default="shipped",
        help="the quickstart configs' shipped targets, or the random tiny ones of benchmarks/tiny_targets.py",
    )
    parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        draft, width, targets, seed, threads = args.child
        print(json.dumps(profile_allocations(draft, int(width), targets, int(seed), int(threads))))
        return
    import torch

    print(f"command: {' '.join(['python', *sys.argv])}")
    print(
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, {args.threads} thread(s), device {args.device}; "
        f"load average {'/'.join(f'{x:.1f}' for x in os.getloadavg())} at the start"
    )
    points = []
    widths = sorted(args.widths)
    for draft in args.drafts:
        mine = []
        for width in widths:
            mine.append(point(draft, width, args))
            print(
                f"  {draft} {width:,}: {mine[-1]['peak_bytes'] / MIB:,.0f} MiB, {mine[-1]['seconds']:.1f} s",
                flush=True,
            )
        report(draft, mine)
        if args.profile:
            report_profile(draft, widths, args)
        points.extend(mine)
    print(f"\nload average {'/'.join(f'{x:.1f}' for x in os.getloadavg())} at the end")
    if args.json:
        args.json.write_text(json.dumps(points, indent=1))


if __name__ == "__main__":
    main()
