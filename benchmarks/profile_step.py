"""Where one packed training step of each draft spends its time, at each thread count.

The same workload as ``benchmarks/throughput.py`` (its target, drafts, documents and packed
micro-batches): one full step (``compute_loss``, backward, AdamW) on the first packed micro-batch,
untimed warmup steps first, then for each thread count (``torch.set_num_threads``, the counts
interleaved ``--repeats`` times in one process) wall and CPU time of the step, and a
``torch.profiler`` pass that reports how many operators one step launches, how much of the step's
operator time sits in calls shorter than ``--small-us`` (each one a parallel region that a second thread
can barely share), and the operators with the most self CPU time.

    .venv/bin/python benchmarks/profile_step.py                        # every draft, 1 and 2 threads
    .venv/bin/python benchmarks/profile_step.py --drafts eagle3 --threads 1 2 --top 15
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import datasets

# Run as a script, so its own folder is on the path: the throughput benchmark's workload and drafts,
# reused as is.
import drafts
import throughput
import torch
from torch.profiler import ProfilerActivity, profile


def step_seconds(module, optimizer, batch, anchors, name: str) -> tuple[float, float]:
    start, cpu_start = time.perf_counter(), time.process_time()
    throughput.train_step(module, optimizer, batch, anchors, name)
    return time.perf_counter() - start, time.process_time() - cpu_start


def profiled(module, optimizer, batch, anchors, name: str, small_us: float, top: int) -> list[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        throughput.train_step(module, optimizer, batch, anchors, name)
    events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    calls = sum(e.count for e in events)
    total = sum(e.self_cpu_time_total for e in events)
    small = sum(e.self_cpu_time_total for e in events if e.self_cpu_time_total / max(e.count, 1) < small_us)
    small_calls = sum(e.count for e in events if e.self_cpu_time_total / max(e.count, 1) < small_us)
    lines = [
        f"  aten calls per step: {calls:,}; self time {total / 1e3:.0f} ms; calls averaging under "
        f"{small_us:.0f} us: {small_calls:,} ({small / max(total, 1):.0%} of the self time)"
    ]
    for event in sorted(events, key=lambda e: -e.self_cpu_time_total)[:top]:
        lines.append(
            f"    {event.key:<52} {event.count:>6} calls {event.self_cpu_time_total / 1e3:>8.1f} ms "
            f"({event.self_cpu_time_total / max(total, 1):.0%}) {event.self_cpu_time_total / event.count:>8.0f} us/call"
        )
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--drafts", nargs="+", choices=drafts.ALL_DRAFTS, default=list(drafts.ALL_DRAFTS))
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per thread count, interleaved")
    parser.add_argument("--small-us", type=float, default=50.0, help="a 'small' operator call, microseconds")
    parser.add_argument("--top", type=int, default=10, help="operators listed per thread count")
    ours, rest = parser.parse_known_args(argv)
    # The workload options (documents, widths, TTT length, ...) are the throughput benchmark's.
    args = throughput.parse_args(rest)
    datasets.disable_progress_bars()
    torch.manual_seed(args.seed)
    device = torch.device("cpu")
    documents = throughput.load_documents(args.max_tokens, args.documents, args.seed)
    print(
        f"torch {torch.__version__}; load average {'/'.join(f'{x:.1f}' for x in os.getloadavg())} at the start"
    )
    for name in ours.drafts:
        plans = {
            layout: throughput.plan(documents, layout, args.max_tokens, args.micro_batch, args.seed)
            for layout in throughput.LAYOUTS
        }
        padded = throughput.collate_all(documents, plans["padded"], device)
        packed = throughput.collate_all(documents, plans["packed"], device)
        module = drafts.build_draft(name, args, padded).to(dtype=args.dtype)
        anchors = None
        if name in drafts.ANCHOR_DRAFTS:
            offsets = throughput.document_anchors(module, padded, plans["padded"], args.seed)
            anchors = throughput.layout_anchors(offsets, plans["packed"], documents.lengths, device)[0]
        batch = packed[0]
        optimizer = torch.optim.AdamW(
            [p for p in module.parameters() if p.requires_grad], lr=args.learning_rate
        )
        for threads in ours.threads:
            torch.set_num_threads(threads)
            throughput.train_step(module, optimizer, batch, anchors, name)
        times: dict[int, list[tuple[float, float, float]]] = {n: [] for n in ours.threads}
        for _ in range(ours.repeats):
            for threads in ours.threads:
                torch.set_num_threads(threads)
                wall, cpu = step_seconds(module, optimizer, batch, anchors, name)
                times[threads].append((wall, cpu, os.getloadavg()[0]))
        real = int(batch["attention_mask"].sum())
        print(f"\n{name}: first packed micro-batch, {tuple(batch['input_ids'].shape)}, {real:,} real tokens")
        base = statistics.median(t[0] for t in times[ours.threads[0]])
        for threads in ours.threads:
            walls = [t[0] for t in times[threads]]
            cpus = [t[1] for t in times[threads]]
            wall, cpu = statistics.median(walls), statistics.median(cpus)
            print(
                f" {threads} thread(s): wall {wall:.2f} s (x{wall / base:.2f} of {ours.threads[0]}), CPU {cpu:.2f} s, "
                f"CPU / wall {cpu / wall:.2f}; steps {', '.join(f'{w:.2f}' for w in walls)} s at load "
                f"{', '.join(f'{t[2]:.1f}' for t in times[threads])}"
            )
            torch.set_num_threads(threads)
            print("\n".join(profiled(module, optimizer, batch, anchors, name, ours.small_us, ours.top)))


if __name__ == "__main__":
    main()
