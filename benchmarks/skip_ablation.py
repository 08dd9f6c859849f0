"""Each draft's work-skipping default against the path before it, interleaved in one process.

The workload, the drafts, the timing and every option are the throughput benchmark's
(``benchmarks/throughput.py``); each draft trains packed and padded, with its skip and without it, the
four series interleaved.

EAGLE-3 runs each TTT step only at the slots with a supervised prediction left (``ttt_live_slots_only``,
the default; step 0's keys and values still run at every slot). Against every slot at every step, it
reports live / all slots per layout, the saved activations of both, and the least-squares fit
``epoch time = a * token slots + b * live slot-steps + c * supervised`` over the four runs (live
slot-steps: the (slot, step) pairs whose query side runs, every one of them without the skip; step 0's
keys and values run at every slot either way).

The block drafts (DFlash, DFlash2, DSpark) draft only the blocks with a supervised chain position and
project only the supervised chain positions onto the vocabulary (``block_valid_only``, the default).
Against every block at every chain position, they report skip / all per layout with the chain positions
projected and the blocks drafted on each path, and the saved activations of both.

    .venv/bin/python benchmarks/skip_ablation.py --drafts eagle3
    .venv/bin/python benchmarks/skip_ablation.py --drafts dflash dflash2 dspark
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import throughput
import torch
from drafts import ANCHOR_DRAFTS
from throughput import LAYOUTS, DraftResult, Run, Series, rates, ratio, saved_per_1k
from torch import Tensor

from lightning_drafts import DraftModule
from lightning_drafts.attention.block_masks import block_layout
from lightning_drafts.blockdraft.objective import block_targets
from lightning_drafts.core.batch import PackedBatch
from lightning_drafts.datamodules.documents import Documents
from lightning_drafts.dspark.eval_mask import block_supervision
from lightning_drafts.eagle3.live_slots import live_slots
from lightning_drafts.eagle3.ttt import ttt_supervision

# The series names of each draft without its skip.
ALL_SLOTS = ", all slots"
ALL_POSITIONS = ", all positions"


def series_of(name: str) -> list[Series]:
    """Packed and padded with the skip, then both without it."""
    every = ALL_SLOTS if name == "eagle3" else ALL_POSITIONS
    return [*throughput.PACKED_VS_PADDED, *(Series(layout + every, layout, skip=False) for layout in LAYOUTS)]


@torch.no_grad()
def live_slot_steps(module: DraftModule, batches: list[dict[str, Tensor]]) -> int:
    """The (slot, step) pairs whose query side EAGLE-3 computes over ``batches`` with the skip (untimed)."""
    total = 0
    for batch in batches:
        packed = module.prepare_batch(batch)
        supervision = ttt_supervision(packed, module.teacher_signal(packed), module.hparams.ttt_length)
        total += sum(slots.numel() for slots in live_slots(supervision))
    return total


@dataclass(frozen=True)
class ChainWork:
    """A block draft's chain positions over an epoch of one layout, and how many the skip keeps."""

    positions: int
    supervised: int
    blocks: int
    supervised_blocks: int


def chain_valid(packed: PackedBatch, anchors: Tensor, block_size: int, dspark: bool) -> Tensor:
    """``[M, D]`` supervision of the chain positions of the blocks at ``anchors`` (DFlash's one known slot)."""
    layout = block_layout(packed, anchors, block_size)
    if dspark:
        return block_supervision(packed, layout).valid
    return block_targets(packed, layout, torch.ones_like(layout.anchors)).valid


@torch.no_grad()
def chain_work(
    module: DraftModule, batches: list[dict[str, Tensor]], anchors: list[Tensor | None], dspark: bool
) -> ChainWork:
    valid = [
        chain_valid(module.prepare_batch(batch), batch_anchors, module.block_size, dspark)
        for batch, batch_anchors in zip(batches, anchors, strict=True)
    ]
    return ChainWork(
        positions=sum(v.numel() for v in valid),
        supervised=sum(int(v.sum()) for v in valid),
        blocks=sum(v.shape[0] for v in valid),
        supervised_blocks=sum(int(v.any(dim=1).sum()) for v in valid),
    )


@dataclass
class SkipResult:
    """A draft's timed series with the work each path does: EAGLE-3's live slot-steps per series, a block
    draft's chain work per layout."""

    timing: DraftResult
    live_slot_steps: dict[str, int] = field(default_factory=dict)
    chain_work: dict[str, ChainWork] = field(default_factory=dict)


def measure(
    name: str,
    args: argparse.Namespace,
    documents: Documents,
    device: torch.device,
    log: Callable[[str], None],
) -> SkipResult:
    module, workload = throughput.prepare_draft(name, args, documents, device)
    series = series_of(name)
    result = SkipResult(throughput.time_draft(name, module, workload, series, args, device, log))
    batches = workload.batches
    if name == "eagle3":
        width = args.ttt_length
        steps = {run.name: width * workload.slots(run.layout) for run in series if not run.skip}
        steps |= {run.name: live_slot_steps(module, batches[run.layout]) for run in series if run.skip}
        result.live_slot_steps = steps
    if name in ANCHOR_DRAFTS:
        result.chain_work = {
            layout: chain_work(module, batches[layout], workload.anchors[layout], name == "dspark")
            for layout in LAYOUTS
        }
    return result


def skip_cells(result: DraftResult, layout: str, every: str, cpu: bool) -> str:
    """The cells of a skip-against-reference row: both median throughputs, their ratio (per-pair range),
    and on CPU the same ratio by CPU time."""
    wall, low, high = ratio(result, "seconds", layout, every)
    cells = (
        f" {statistics.median(rates(result, layout, 'seconds')):,.0f} | "
        f"{statistics.median(rates(result, every, 'seconds')):,.0f} | {wall:.2f}x ({low:.2f}-{high:.2f}) |"
    )
    if cpu:
        cpu_ratio, cpu_low, cpu_high = ratio(result, "cpu_seconds", layout, every)
        cells += f" {cpu_ratio:.2f}x ({cpu_low:.2f}-{cpu_high:.2f}) |"
    return cells


def all_slots_section(result: SkipResult, cpu: bool) -> list[str]:
    """EAGLE-3 with the live-slot skip against every slot at every step, and the linear time fit."""
    timing, steps = result.timing, result.live_slot_steps
    cpu_head, cpu_rule = (" live / all by CPU time |", "---:|") if cpu else ("", "")
    lines = [
        "",
        "EAGLE-3, TTT steps at live slots only (default) vs every slot (`ttt_live_slots_only=False`):",
        "",
        f"| layout | live slots, real tokens/s | all slots, real tokens/s | live / all (pairs) |{cpu_head} "
        "live slot-steps, live / all | saved act. MiB / 1k real tokens, live / all |",
        f"|---|---:|---:|---:|{cpu_rule}---:|---:|",
    ]
    for layout in LAYOUTS:
        every = layout + ALL_SLOTS
        lines.append(
            f"| {layout} |{skip_cells(timing, layout, every, cpu)} "
            f"{steps[layout]:,} / {steps[every]:,} | "
            f"{saved_per_1k(timing, layout):.0f} / {saved_per_1k(timing, every):.0f} |"
        )
    # On CPU the fit takes process CPU time: on a shared machine the wall time is mostly other processes'.
    lines += ["", *time_fit(timing, steps, "cpu_seconds" if cpu else "seconds")]
    return lines


def all_positions_section(result: SkipResult, cpu: bool) -> list[str]:
    """A block draft with the supervised-block / position skip against every block and position."""
    timing = result.timing
    cpu_head, cpu_rule = (" skip / all by CPU time |", "---:|") if cpu else ("", "")
    lines = [
        "",
        f"{timing.name}, supervised blocks and chain positions only (default) vs every block and position "
        "(`block_valid_only=False`):",
        "",
        f"| layout | skip, supervised positions/s | all, supervised positions/s | skip / all (pairs) |{cpu_head} "
        "vocabulary rows, skip / all | blocks drafted, skip / all | saved act. MiB / 1k real tokens, skip / all |",
        f"|---|---:|---:|---:|{cpu_rule}---:|---:|---:|",
    ]
    for layout in LAYOUTS:
        every, work = layout + ALL_POSITIONS, result.chain_work[layout]
        # Every DSpark block has a supervised slot 0; DFlash's blocks without one are not drafted.
        lines.append(
            f"| {layout} |{skip_cells(timing, layout, every, cpu)} {work.supervised:,} / {work.positions:,} | "
            f"{work.supervised_blocks:,} / {work.blocks:,} | "
            f"{saved_per_1k(timing, layout):.0f} / {saved_per_1k(timing, every):.0f} |"
        )
    return lines


def time_fit(result: DraftResult, steps: dict[str, int], clock: str) -> list[str]:
    """Least squares ``median epoch time = a * token slots + b * live slot-steps + c * supervised`` (by
    ``clock``: ``"seconds"`` or ``"cpu_seconds"``) over the timed series, with each term's share of every
    series' fitted time."""
    names = [run.name for run in result.series]
    features = np.array(
        [
            [
                result.workload.slots(result.layout(name)),
                steps[name],
                result.epochs[name][0].supervised,
            ]
            for name in names
        ],
        dtype=float,
    )
    seconds = np.array([statistics.median(getattr(e, clock) for e in result.epochs[name]) for name in names])
    coefficients, *_ = np.linalg.lstsq(features, seconds, rcond=None)
    a, b, c = (1e6 * x for x in coefficients)
    lines = [
        f"Fit over the {len(names)} series: time = a * token slots + b * live slot-steps + c * supervised, "
        f"a = {a:.0f} us, b = {b:.0f} us, c = {c:.0f} us ({'CPU time' if clock == 'cpu_seconds' else 'wall'}, "
        "median epoch).",
        "",
        "| series | token slots | live slot-steps | supervised | measured s | fitted s | a / b / c share |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for name, row, measured in zip(names, features, seconds, strict=True):
        terms = row * coefficients
        shares = " / ".join(f"{t / terms.sum():.0%}" for t in terms)
        lines.append(
            f"| {name} | {row[0]:,.0f} | {row[1]:,.0f} | {row[2]:,.0f} | {measured:.1f} | {terms.sum():.1f} | "
            f"{shares} |"
        )
    return lines


def report(run: Run[SkipResult]) -> str:
    """The throughput benchmark's tables over the four series of each draft, then each draft's skip
    against its path without it."""
    timings = [result.timing for result in run.results]
    lines = [run.header, "", *throughput.layout_tables(timings, run.cpu)]
    for result in run.results:
        section = all_slots_section if result.timing.name == "eagle3" else all_positions_section
        lines += section(result, run.cpu)
    return "\n".join(lines + run.ending(timings))


def main(argv: list[str] | None = None) -> None:
    args = throughput.device_defaults(throughput.workload_parser(__doc__.split("\n")[0]).parse_args(argv))
    print(report(throughput.run_drafts(args, measure)))


if __name__ == "__main__":
    main()
