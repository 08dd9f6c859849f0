"""The packed layout of each draft at several thread counts, interleaved in one process.

The workload, the drafts, the timing and every option are the throughput benchmark's
(``benchmarks/throughput.py``); only the packed layout runs, once per count of ``--thread-counts``
(``torch.set_num_threads`` between interleaved epochs). Reported: wall and CPU time at each count, their
ratios to the first, and the load average at the end of every epoch: on a shared machine the 2-thread wall
time depends on what else runs.

    .venv/bin/python benchmarks/thread_scaling.py --thread-counts 1 2 --documents 16
"""

from __future__ import annotations

import functools
import statistics

import throughput
from throughput import DraftResult, Run, Series


def series_of(thread_counts: list[int]) -> list[Series]:
    return [Series(f"packed, {n} thread{'s' * (n > 1)}", "packed", threads=n) for n in thread_counts]


def thread_scaling_report(results: list[DraftResult], threads: list[int]) -> list[str]:
    """Each draft's packed epoch at every thread count: wall and CPU time (median), their ratios to the
    first count's, the per-pair wall ratios, and the load average beside each epoch."""
    first = threads[0]
    lines = [
        f"Packed layout at {', '.join(map(str, threads))} threads, interleaved epochs in one process; "
        f"ratios are to {first} thread{'s' * (first > 1)}, load = 1-minute load average at each epoch's end:",
        "",
        "| draft | threads | wall s (median) | CPU s (median) | CPU / wall | wall ratio (pairs) | CPU ratio | "
        "wall s per epoch | load per epoch |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for result in results:
        names = [run.name for run in result.series]
        base = result.epochs[names[0]]
        for count, name in zip(threads, names, strict=True):
            epochs = result.epochs[name]
            wall = statistics.median(e.seconds for e in epochs)
            cpu_time = statistics.median(e.cpu_seconds for e in epochs)
            pairs = [e.seconds / b.seconds for e, b in zip(epochs, base, strict=True)]
            lines.append(
                f"| {result.name} | {count} | {wall:.1f} | {cpu_time:.1f} | {cpu_time / wall:.2f} | "
                f"{wall / statistics.median(b.seconds for b in base):.2f} ({min(pairs):.2f}-{max(pairs):.2f}) | "
                f"{cpu_time / statistics.median(b.cpu_seconds for b in base):.2f} | "
                f"{', '.join(f'{e.seconds:.1f}' for e in epochs)} | {', '.join(f'{e.load:.1f}' for e in epochs)} |"
            )
    return lines


def report(run: Run[DraftResult], thread_counts: list[int]) -> str:
    lines = [run.header, "", *thread_scaling_report(run.results, thread_counts)]
    return "\n".join(lines + run.ending(run.results))


def main(argv: list[str] | None = None) -> None:
    parser = throughput.workload_parser(__doc__.split("\n")[0])
    parser.add_argument(
        "--thread-counts",
        type=int,
        nargs="+",
        default=[1, 2],
        metavar="THREADS",
        help="the thread counts to time the packed layout at, interleaved in one process",
    )
    args = throughput.device_defaults(parser.parse_args(argv))
    measure = functools.partial(throughput.measure_draft, series=series_of(args.thread_counts))
    print(report(throughput.run_drafts(args, measure, args.thread_counts), args.thread_counts))


if __name__ == "__main__":
    main()
