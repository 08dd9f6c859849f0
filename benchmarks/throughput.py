"""Packed vs padded training throughput of every draft: the same documents, weights and optimizer, one process.

For each draft, a fixed random subset of the embedded chat corpus (its real length distribution,
documents truncated to ``--max-tokens``) is trained for whole epochs in two layouts:

* packed: ``packing="buffer"``, best-fit-decreasing rows of ``--max-tokens``, ``--micro-batch`` rows a step;
* padded: ``packing=False``, one document per row, ``--micro-batch`` documents a step, each micro-batch
  padded to its longest document.

What keeps the comparison honest:

* both layouts train the same documents once per epoch; every epoch starts from the same draft
  weights and a fresh AdamW (a full step: zero_grad, ``compute_loss``, backward, ``optimizer.step``);
* anchor-based drafts get the same anchors per document in both layouts (drawn once per document
  with a fixed generator by the module's own ``sample_anchors`` on the padded layout, then moved to
  each document's column in its packed row), so both layouts supervise exactly the same positions;
  the script fails if the supervised counts of the two layouts differ (EAGLE-3 included);
* repetitions alternate packed, padded, packed, padded, ... so load drift on a shared machine hits
  both layouts alike; the thread count is fixed; untimed warmup steps come first (``--warmup``: one
  micro-batch per layout on CPU; a whole epoch per layout on CUDA, where each new shape compiles);
* micro-batches are collated before timing: the loader's cost (see ``benchmarks/packing.py``) is not
  the draft's;
* on CPU, process CPU time is reported beside wall time: with ``--threads 1`` it is what the epoch
  cost, whatever else the machine ran meanwhile.

Reported per draft: real (non-padding) tokens per second for EAGLE-3, whose work is token-proportional;
supervised positions per second (chain positions of the anchor blocks) for DFlash / DFlash2 / DSpark;
the packed / padded ratio of medians beside the padding-limit ratio ``1 / (1 - padding fraction of
the padded run)``, and the fraction of that limit achieved. Memory, measured two ways:

* saved activations: the bytes of the distinct tensor storages autograd saves for backward during
  each micro-batch (``torch.autograd.graph.saved_tensors_hooks``; parameters excluded), from the first
  timed epoch. It depends only on the computation, so it compares layouts exactly; it is reported per
  1k real tokens (the comparison at an equal real-token count) and for the largest micro-batch;
* peak process memory of each timed epoch: on CUDA ``torch.cuda.max_memory_allocated`` above the
  allocation at the epoch start; on CPU the growth of the resident-set high-water mark (``VmHWM``,
  reset through ``/proc/self/clear_refs`` at the epoch start, after ``malloc_trim`` returned freed heap
  to the system) over the resident set at the start: process-wide, it includes allocator caching and
  is noisier than the saved-activation figure.

The target and drafts are ``benchmarks/drafts.py``'s: a Llama-shaped random model whose width makes its
linear layers dominate, with the embedded tokenizer's 32,000-token vocabulary. EAGLE-3 trains a
4,096-token draft vocabulary; the target's LM-head rows outside it are zeroed so the random teacher's
greedy token lands inside it, as a trained target's does (otherwise 7 positions in 8 would leave the loss
and the benchmark would skip the draft's LM-head work).

EAGLE-3 runs each TTT step only at the slots with a supervised prediction left (``ttt_live_slots_only``,
the default); the block drafts draft only the blocks with a supervised chain position and project only
those positions onto the vocabulary (``block_valid_only``, the default). ``benchmarks/skip_ablation.py``
times each draft with and without its skip, on this workload and with these options;
``benchmarks/thread_scaling.py`` times the packed layout at several thread counts. Every run, of this
script or of those two, ends with each series' model FLOPs per second against the machine's matmul rate.

    .venv/bin/python benchmarks/throughput.py --documents 16          # a few minutes on 2 CPU cores
    .venv/bin/python benchmarks/throughput.py --device cuda --documents 512
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import datasets
import numpy as np
import torch
from drafts import ALL_DRAFTS, ANCHOR_DRAFTS, build_draft, target_config
from model_flops import MatmulRate, counted_flops, matmul_rate
from torch import Tensor

from lightning_drafts import DraftModule
from lightning_drafts.attention.anchors import anchors_from_positions
from lightning_drafts.datamodules import PackedChatDataModule
from lightning_drafts.datamodules.documents import Documents
from lightning_drafts.datamodules.embedded import EMBEDDED_PAD_TOKEN_ID
from lightning_drafts.datamodules.packing import MicroBatchPlan, collate, plan_epoch

LAYOUTS = ("packed", "padded")


@dataclass
class Workload:
    """One draft's micro-batches in both layouts, with the fixed anchors of the anchor-based drafts."""

    batches: dict[str, list[dict[str, Tensor]]]
    anchors: dict[str, list[Tensor | None]]

    def real_tokens(self, layout: str) -> int:
        return sum(int(b["attention_mask"].sum()) for b in self.batches[layout])

    def slots(self, layout: str) -> int:
        return sum(b["attention_mask"].numel() for b in self.batches[layout])


@dataclass(frozen=True)
class Series:
    """One timed configuration: a layout, whether the draft's skip is on (EAGLE-3: TTT steps at live slots
    only; block drafts: supervised blocks and chain positions only), and the thread count (``None``:
    ``--threads``). This script times the two layouts with the defaults; the ablations vary the rest."""

    name: str
    layout: str
    skip: bool = True
    threads: int | None = None


PACKED_VS_PADDED = [Series(layout, layout) for layout in LAYOUTS]


@dataclass
class Epoch:
    """One timed epoch of one layout: wall time, supervised positions, memory."""

    seconds: float
    cpu_seconds: float
    supervised: int
    peak_bytes: int
    saved_bytes: list[int] = field(default_factory=list)
    # The 1-minute load average at the epoch's end: on a shared machine, what the thread figures ran beside.
    load: float = 0.0


# --- documents and layouts -------------------------------------------------------------------------


def load_documents(max_tokens: int, count: int, seed: int) -> Documents:
    """``count`` documents drawn at random (seeded) from the embedded corpus, truncated to ``max_tokens``."""
    corpus = PackedChatDataModule(max_tokens=max_tokens)
    corpus.setup()
    documents = corpus.train_documents
    if count > len(documents):
        raise ValueError(f"--documents {count} exceeds the corpus' {len(documents)} documents")
    chosen = np.random.default_rng(seed).choice(len(documents), size=count, replace=False)
    return documents.select(np.sort(chosen))


def plan(documents: Documents, layout: str, max_tokens: int, micro_batch: int, seed: int) -> MicroBatchPlan:
    mode = "buffer" if layout == "packed" else "padded"
    return plan_epoch(
        documents.lengths, mode=mode, max_tokens=max_tokens, batch_size=micro_batch, seed=seed, epoch=0
    )


def collate_all(documents: Documents, epoch_plan: MicroBatchPlan, device: torch.device) -> list[dict]:
    return [
        {k: v.to(device) for k, v in collate(documents, epoch_plan, i, EMBEDDED_PAD_TOKEN_ID).items()}
        for i in range(len(epoch_plan))
    ]


def document_anchors(
    module: DraftModule, padded: list[dict[str, Tensor]], padded_plan: MicroBatchPlan, seed: int
) -> dict[int, Tensor]:
    """Document index -> its anchors as offsets inside the document, drawn by the module's own sampler.

    In the padded layout a row is a document, so each row's anchors are that document's, within the
    module's per-document budget.
    """
    generator = torch.Generator().manual_seed(seed)
    offsets: dict[int, Tensor] = {}
    for index, batch in enumerate(padded):
        anchors = module.sample_anchors(batch, generator=generator).cpu()
        for row, doc in enumerate(np.concatenate(padded_plan.batch_documents(index)).tolist()):
            offsets[doc] = anchors[row][anchors[row] >= 0]
    return offsets


def layout_anchors(
    offsets: dict[int, Tensor], epoch_plan: MicroBatchPlan, lengths: np.ndarray, device: torch.device
) -> list[Tensor]:
    """``[B, N]`` anchors of every micro-batch of ``epoch_plan``: each document's offsets at its column."""
    result = []
    for index in range(len(epoch_plan)):
        rows, positions = [], []
        for row, docs in enumerate(epoch_plan.batch_documents(index)):
            columns = np.concatenate([[0], np.cumsum(lengths[docs])[:-1]])
            for doc, column in zip(docs.tolist(), columns.tolist(), strict=True):
                positions.append(offsets[doc] + column)
                rows.append(torch.full_like(offsets[doc], row))
        batch = int(epoch_plan.batch_bounds[index + 1] - epoch_plan.batch_bounds[index])
        anchors = anchors_from_positions(torch.cat(rows), torch.cat(positions), batch)
        result.append(anchors.to(device))
    return result


# --- measurement -----------------------------------------------------------------------------------


def supervised_count(output: Any, name: str) -> Tensor:
    """EAGLE-3: supervised (slot, step) predictions; block drafts: valid chain positions of the blocks."""
    return torch.as_tensor(output.valid_tokens) if name == "eagle3" else output.valid.sum()


def train_step(
    module: DraftModule, optimizer: torch.optim.Optimizer, batch: dict, anchors: Tensor | None, name: str
) -> Tensor:
    optimizer.zero_grad(set_to_none=True)
    output = module.compute_loss(batch) if anchors is None else module.compute_loss(batch, anchors=anchors)
    output.loss.backward()
    optimizer.step()
    return supervised_count(output, name).detach()


@contextmanager
def saved_activation_bytes(parameters: set[int], sink: list[int]) -> Iterator[None]:
    """Append the bytes of the distinct storages autograd saves inside the block (parameters excluded)."""
    storages: dict[int, int] = {}

    def pack(tensor: Tensor) -> Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield
    sink.append(sum(storages.values()))


def warmup(
    module: DraftModule,
    optimizer: torch.optim.Optimizer,
    workload: Workload,
    layout: str,
    name: str,
    count: int,
) -> None:
    """Untimed steps on the first ``count`` micro-batches (all when negative): allocator, caches, and on
    CUDA the compilation of every shape the epoch brings."""
    pairs = list(zip(workload.batches[layout], workload.anchors[layout], strict=True))
    for batch, anchors in pairs if count < 0 else pairs[:count]:
        train_step(module, optimizer, batch, anchors, name)


def resident_kib(field_name: str) -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field_name}")


def release_free_heap() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the growth figure is then a lower bound
        pass


class PeakMemory:
    """Peak memory growth over one epoch: CUDA allocations, or the resident-set high-water mark on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.start = 0

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
            return
        # Freed heap memory stays resident and would hide this epoch's growth behind an earlier
        # draft's peak; glibc hands it back on request.
        release_free_heap()
        # Writing 5 resets VmHWM to the current resident set (Linux >= 4.0).
        with open("/proc/self/clear_refs", "w", encoding="ascii") as clear:
            clear.write("5")
        self.start = resident_kib("VmRSS") * 1024

    def peak(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self.start
        return resident_kib("VmHWM") * 1024 - self.start


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_epoch(
    module: DraftModule,
    optimizer: torch.optim.Optimizer,
    workload: Workload,
    layout: str,
    name: str,
    memory: PeakMemory,
) -> Epoch:
    parameters = {p.untyped_storage().data_ptr() for p in module.parameters()}
    memory.reset()
    supervised, saved = [], []
    synchronize(memory.device)
    start, cpu_start = time.perf_counter(), time.process_time()
    for batch, anchors in zip(workload.batches[layout], workload.anchors[layout], strict=True):
        # The hook costs microseconds per saved tensor, alike in both layouts.
        with saved_activation_bytes(parameters, saved):
            supervised.append(train_step(module, optimizer, batch, anchors, name))
    synchronize(memory.device)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    total = int(torch.stack(supervised).sum())
    return Epoch(seconds, cpu_seconds, total, memory.peak(), saved, os.getloadavg()[0])


class FreshStart:
    """Restores the draft's initial weights and hands out a fresh AdamW for every epoch."""

    def __init__(self, module: DraftModule, learning_rate: float) -> None:
        self.module = module
        self.learning_rate = learning_rate
        self.initial = {k: v.detach().clone() for k, v in module.draft_state_dict().items()}

    def __call__(self) -> torch.optim.Optimizer:
        with torch.no_grad():
            state = self.module.state_dict()
            for key, value in self.initial.items():
                state[key].copy_(value)
        params = [p for p in self.module.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=self.learning_rate)


# --- one draft -------------------------------------------------------------------------------------


@dataclass
class DraftResult:
    name: str
    workload: Workload
    epochs: dict[str, list[Epoch]]
    micro_batches: dict[str, int]
    series: list[Series]
    # Model FLOPs of one epoch of each series (FlopCounterMode over forward and backward; model_flops.py).
    flops: dict[str, int] = field(default_factory=dict)

    def layout(self, series_name: str) -> str:
        return next(s.layout for s in self.series if s.name == series_name)


# Each draft's skip flag (read at every step), on by default.
SKIP_FLAGS = ("ttt_live_slots_only", "block_valid_only")


@contextmanager
def configured(module: DraftModule, series: Series) -> Iterator[None]:
    """One epoch of ``series``: its thread count, and the draft with or without its skip."""
    threads = torch.get_num_threads()
    torch.set_num_threads(series.threads or threads)
    flags = [flag for flag in SKIP_FLAGS if flag in module.hparams]
    for flag in flags:
        module.hparams[flag] = series.skip
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        for flag in flags:
            module.hparams[flag] = True


def epoch_flops(module: DraftModule, fresh: FreshStart, workload: Workload, run: Series, name: str) -> int:
    """Model FLOPs of one (untimed) epoch of ``run``: FlopCounterMode over every step (model_flops.py)."""
    pairs = list(zip(workload.batches[run.layout], workload.anchors[run.layout], strict=True))
    with configured(module, run):
        optimizer = fresh()

        def epoch() -> None:
            for batch, anchors in pairs:
                train_step(module, optimizer, batch, anchors, name)

        return counted_flops(epoch)


def prepare_draft(
    name: str, args: argparse.Namespace, documents: Documents, device: torch.device
) -> tuple[DraftModule, Workload]:
    """The draft ``name`` and its micro-batches in both layouts, with the anchors fixed per document."""
    plans = {
        layout: plan(documents, layout, args.max_tokens, args.micro_batch, args.seed) for layout in LAYOUTS
    }
    batches = {layout: collate_all(documents, plans[layout], device) for layout in LAYOUTS}
    module = build_draft(name, args, batches["padded"]).to(device=device, dtype=args.dtype)
    anchors: dict[str, list[Tensor | None]] = {layout: [None] * len(batches[layout]) for layout in LAYOUTS}
    if name in ANCHOR_DRAFTS:
        offsets = document_anchors(module, batches["padded"], plans["padded"], args.seed)
        anchors = {
            layout: layout_anchors(offsets, plans[layout], documents.lengths, device) for layout in LAYOUTS
        }
    return module, Workload(batches=batches, anchors=anchors)


def time_draft(
    name: str,
    module: DraftModule,
    workload: Workload,
    series: list[Series],
    args: argparse.Namespace,
    device: torch.device,
    log: Callable[[str], None],
) -> DraftResult:
    """Warm up every series, then ``--repeats`` interleaved timed epochs of each, then each one's FLOPs."""
    batches = workload.batches
    fresh = FreshStart(module, args.learning_rate)
    memory = PeakMemory(device)
    for run in series:
        log(f"{name}: warmup, {run.name} ({len(batches[run.layout])} micro-batches an epoch)")
        with configured(module, run):
            warmup(module, fresh(), workload, run.layout, name, args.warmup)
    epochs: dict[str, list[Epoch]] = {run.name: [] for run in series}
    for repeat in range(args.repeats):
        for run in series:
            with configured(module, run):
                epoch = timed_epoch(module, fresh(), workload, run.layout, name, memory)
            epochs[run.name].append(epoch)
            log(f"{name}: repeat {repeat + 1}/{args.repeats} {run.name}: {epoch.seconds:.1f} s")
    flops = {run.name: epoch_flops(module, fresh, workload, run, name) for run in series}
    counts = {run.name: {e.supervised for e in epochs[run.name]} for run in series}
    if len(set().union(*counts.values())) != 1:
        raise RuntimeError(f"{name}: the runs supervised different positions: {counts}")
    return DraftResult(
        name=name,
        workload=workload,
        epochs=epochs,
        micro_batches={layout: len(batches[layout]) for layout in LAYOUTS},
        series=series,
        flops=flops,
    )


def measure_draft(
    name: str,
    args: argparse.Namespace,
    documents: Documents,
    device: torch.device,
    log: Callable[[str], None],
    series: list[Series] = PACKED_VS_PADDED,
) -> DraftResult:
    """The draft ``name`` timed over ``series`` (default: packed against padded, each draft's defaults)."""
    module, workload = prepare_draft(name, args, documents, device)
    return time_draft(name, module, workload, series, args, device, log)


# --- report ----------------------------------------------------------------------------------------

MIB = 2**20


def work(result: DraftResult, name: str) -> int:
    """Real tokens for EAGLE-3 (token-proportional work); supervised positions for the block drafts."""
    return (
        result.workload.real_tokens(result.layout(name))
        if result.name == "eagle3"
        else result.epochs[name][0].supervised
    )


def rates(result: DraftResult, name: str, clock: str) -> list[float]:
    """Throughput of every epoch of series ``name`` by wall-clock (``"seconds"``) or process CPU time."""
    return [work(result, name) / getattr(epoch, clock) for epoch in result.epochs[name]]


def ratio(
    result: DraftResult, clock: str, first: str = "packed", second: str = "padded"
) -> tuple[float, float, float]:
    """first / second (default packed / padded) of the median throughputs, and the range of the
    per-pair (interleaved) ratios."""
    a, b = rates(result, first, clock), rates(result, second, clock)
    pairs = [x / y for x, y in zip(a, b, strict=True)]
    return statistics.median(a) / statistics.median(b), min(pairs), max(pairs)


def saved_per_1k(result: DraftResult, name: str) -> float:
    """Saved activations of series ``name``'s first timed epoch, MiB per 1k real tokens."""
    tokens = result.workload.real_tokens(result.layout(name)) / 1000
    return sum(result.epochs[name][0].saved_bytes) / MIB / tokens


def padding_fraction(result: DraftResult, layout: str) -> float:
    return 1 - result.workload.real_tokens(layout) / result.workload.slots(layout)


def summary_row(result: DraftResult, cpu: bool) -> str:
    wall, low, high = ratio(result, "seconds")
    limit = 1 / (1 - padding_fraction(result, "padded"))
    measure = "real tokens/s" if result.name == "eagle3" else "supervised positions/s"
    cpu_cells = ""
    if cpu:
        cpu_ratio, cpu_low, cpu_high = ratio(result, "cpu_seconds")
        cpu_cells = f" {cpu_ratio:.2f}x ({cpu_low:.2f}-{cpu_high:.2f}), {cpu_ratio / limit:.0%} of limit |"

    def per_1k(layout: str) -> float:
        return saved_per_1k(result, layout)

    def largest(layout: str) -> float:
        return max(result.epochs[layout][0].saved_bytes) / MIB

    def peak(layout: str) -> float:
        return max(e.peak_bytes for e in result.epochs[layout]) / MIB

    return (
        f"| {result.name} | {measure} | {statistics.median(rates(result, 'packed', 'seconds')):,.0f} | "
        f"{statistics.median(rates(result, 'padded', 'seconds')):,.0f} | {wall:.2f}x ({low:.2f}-{high:.2f}) | "
        f"{padding_fraction(result, 'padded'):.1%} | {limit:.2f}x | {wall / limit:.0%} |{cpu_cells} "
        f"{per_1k('packed'):.0f} / {per_1k('padded'):.0f} | {largest('packed'):.0f} / {largest('padded'):.0f} | "
        f"{peak('packed'):.0f} / {peak('padded'):.0f} |"
    )


def detail_rows(result: DraftResult) -> list[str]:
    rows = []
    for run in result.series:
        epochs, layout = result.epochs[run.name], run.layout
        rows.append(
            f"| {result.name} | {run.name} | {result.micro_batches[layout]} | "
            f"{result.workload.real_tokens(layout):,} | {result.workload.slots(layout):,} | "
            f"{padding_fraction(result, layout):.1%} | {epochs[0].supervised:,} | "
            f"{', '.join(f'{e.seconds:.1f}' for e in epochs)} | {', '.join(f'{e.cpu_seconds:.1f}' for e in epochs)} |"
        )
    return rows


def layout_tables(results: list[DraftResult], cpu: bool) -> list[str]:
    """The packed / padded summary (a row per draft) and every series' epochs (a row per series)."""
    cpu_head, cpu_rule = (" packed/padded by CPU time |", "---:|") if cpu else ("", "")
    lines = [
        "| draft | measure | packed | padded | packed/padded (pairs) | padding (padded) | limit 1/(1-p) | "
        f"of limit |{cpu_head} saved act. MiB / 1k real tokens (packed / padded) | largest micro-batch saved "
        "act. MiB (packed / padded) | peak memory growth MiB (packed / padded) |",
        f"|---|---|---:|---:|---:|---:|---:|---:|{cpu_rule}---:|---:|---:|",
        *(summary_row(result, cpu) for result in results),
        "",
        "Per layout (epoch times in run order):",
        "",
        "| draft | layout | micro-batches | real tokens | token slots | padding | supervised | wall s | CPU s |",
        "|---|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for result in results:
        lines += detail_rows(result)
    return lines


def measure_limits(counts: list[int], dtype: torch.dtype, device: torch.device) -> dict[int, MatmulRate]:
    """The large-matmul rate at each thread count (model_flops.matmul_rate)."""
    previous = torch.get_num_threads()
    rates = {}
    for count in counts:
        torch.set_num_threads(count)
        rates[count] = matmul_rate(dtype=dtype, device=device)
    torch.set_num_threads(previous)
    return rates


def best_limits(*measured: dict[int, MatmulRate]) -> dict[int, MatmulRate]:
    """Per thread count, the best rate of the measurements (a busy moment only lowers a rate)."""
    return {
        count: MatmulRate(
            measured[0][count].size,
            max(m[count].per_second for m in measured),
            max(m[count].per_cpu_second for m in measured),
        )
        for count in measured[0]
    }


def flops_section(
    results: list[DraftResult], limits: dict[int, MatmulRate], threads: int, cpu: bool
) -> list[str]:
    """Each series' model FLOPs per second (median epoch) against the large-matmul rate at its thread count."""
    size = next(iter(limits.values())).size
    lines = [
        "",
        f"Model FLOPs per second against this machine's {size} x {size} matmul rate, measured in this run at "
        "the start and the end (best of both): "
        + ", ".join(
            f"{count} thread{'s' * (count > 1)}: {rate.per_second / 1e9:.1f} GFLOP/s wall"
            + (f", {rate.per_cpu_second / 1e9:.1f} GFLOP per CPU-second" if cpu else "")
            for count, rate in limits.items()
        )
        + ". Model FLOPs: FlopCounterMode over each step's forward and backward (matrix products and "
        "attention kernels; benchmarks/model_flops.py).",
        "",
        "| draft | series | model GFLOP per epoch | GFLOP/s (wall) | of the matmul rate |"
        + (" GFLOP per CPU-second | of the matmul rate, CPU time |" if cpu else ""),
        "|---|---|---:|---:|---:|" + ("---:|---:|" if cpu else ""),
    ]
    for result in results:
        for run in result.series:
            flops, epochs = result.flops[run.name], result.epochs[run.name]
            limit = limits[run.threads or threads]
            wall = flops / statistics.median(e.seconds for e in epochs)
            row = (
                f"| {result.name} | {run.name} | {flops / 1e9:,.1f} | {wall / 1e9:.1f} | "
                f"{wall / limit.per_second:.0%} |"
            )
            if cpu:
                per_cpu = flops / statistics.median(e.cpu_seconds for e in epochs)
                row += f" {per_cpu / 1e9:.1f} | {per_cpu / limit.per_cpu_second:.0%} |"
            lines.append(row)
    return lines


R = TypeVar("R")


@dataclass
class Run(Generic[R]):
    """One run over ``--drafts``: each draft's result, the drafts skipped and why, the matmul rates at each
    thread count, and the report's header."""

    results: list[R]
    skipped: dict[str, str]
    limits: dict[int, MatmulRate]
    header: str
    threads: int
    cpu: bool

    def ending(self, results: list[DraftResult]) -> list[str]:
        """What every report ends with: the FLOPs section of ``results`` and the drafts skipped."""
        lines = flops_section(results, self.limits, self.threads, self.cpu)
        return lines + [f"\n{name}: skipped: {why}" for name, why in self.skipped.items()]


def report(run: Run[DraftResult]) -> str:
    lines = [run.header, "", *layout_tables(run.results, run.cpu)]
    return "\n".join(lines + run.ending(run.results))


# --- command line ----------------------------------------------------------------------------------


def workload_parser(description: str) -> argparse.ArgumentParser:
    """The options of the workload, the drafts and the timing, shared by the scripts that reuse them."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--drafts", nargs="+", choices=ALL_DRAFTS, default=list(ALL_DRAFTS))
    parser.add_argument("--documents", type=int, default=64, help="documents in the fixed subset")
    parser.add_argument("--max-tokens", type=int, default=1024, help="packed row width, document limit")
    parser.add_argument(
        "--micro-batch", type=int, default=8, help="rows (packed) / documents (padded) a step"
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed epochs per layout, interleaved")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=None,
        help="model dtype (default: float32 on CPU, bfloat16 on CUDA)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hidden-size", type=int, default=512, help="target (and draft) width")
    parser.add_argument("--target-layers", type=int, default=4)
    parser.add_argument("--ttt-length", type=int, default=7, help="EAGLE-3 TTT steps")
    parser.add_argument("--draft-vocab-size", type=int, default=4096, help="EAGLE-3 draft vocabulary")
    parser.add_argument("--draft-layers", type=int, default=2, help="DFlash / DFlash2 / DSpark draft layers")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--anchors", type=int, default=16, help="anchors per document (block drafts)")
    parser.add_argument(
        "--logits-chunk-blocks",
        type=int,
        default=None,
        help="block drafts' logits_chunk_blocks (default: each module's; 0: no chunking, no recompute)",
    )
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed micro-batches per layout before timing (-1: an epoch; default 1 on CPU, "
        "an epoch on CUDA, where every new shape compiles)",
    )
    return parser


def device_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """``--warmup`` and ``--dtype`` when not given: their defaults depend on ``--device``."""
    if args.warmup is None:
        args.warmup = -1 if args.device == "cuda" else 1
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    args.dtype = getattr(torch, args.dtype)
    return args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return device_defaults(workload_parser(__doc__.split("\n")[0]).parse_args(argv))


def header(
    args: argparse.Namespace,
    command: str,
    documents: Documents,
    device: torch.device,
    loads: tuple[tuple[float, ...], tuple[float, ...]],
    thread_counts: list[int],
) -> str:
    """The machine, the load, the documents, the target and the drafts of a run."""
    target = target_config(args)
    load_before, load_after = loads
    return "\n".join(
        [
            f"Command: `{command}`",
            "",
            f"torch {torch.__version__}, device {device}"
            + (
                f" ({torch.cuda.get_device_name(device)})"
                if device.type == "cuda"
                else f", {'/'.join(map(str, thread_counts))} threads"
            )
            + f", {str(args.dtype).removeprefix('torch.')}; load average (1/5/15 min) "
            f"{'/'.join(f'{x:.1f}' for x in load_before)} at the start, "
            f"{'/'.join(f'{x:.1f}' for x in load_after)} at the end.",
            f"Documents: {len(documents)} of the embedded corpus (seed {args.seed}), {documents.num_tokens:,} "
            f"tokens, median {int(np.median(documents.lengths))}, truncated to {args.max_tokens}. "
            f"Micro-batch {args.micro_batch} rows of {args.max_tokens} (packed) / {args.micro_batch} "
            f"documents (padded); {args.repeats} interleaved timed epochs per layout after "
            f"{'a warmup epoch' if args.warmup < 0 else f'{args.warmup} warmup micro-batch(es)'} per layout.",
            f"Target: Llama, hidden {target['hidden_size']}, MLP {target['intermediate_size']}, "
            f"{target['num_hidden_layers']} layers, {target['num_attention_heads']} heads / "
            f"{target['num_key_value_heads']} KV heads, vocabulary {target['vocab_size']}. EAGLE-3: "
            f"ttt_length {args.ttt_length}, draft vocabulary {args.draft_vocab_size}. Block drafts: "
            f"{args.draft_layers} draft layers, block {args.block_size}, {args.anchors} anchors per document, "
            f"logits_chunk_blocks {'module default' if args.logits_chunk_blocks is None else args.logits_chunk_blocks}.",
            "Throughput columns are medians over the repeats; 'of limit' = (packed/padded) / limit.",
        ]
    )


def run_drafts(
    args: argparse.Namespace,
    measure: Callable[[str, argparse.Namespace, Documents, torch.device, Callable[[str], None]], R],
    thread_counts: list[int] | None = None,
) -> Run[R]:
    """``measure`` every draft of ``--drafts`` on the same documents, between two measurements of the
    matmul rate at each of ``thread_counts`` (default: ``--threads``)."""
    datasets.disable_progress_bars()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda was requested but CUDA is not available")
    torch.manual_seed(args.seed)

    def log(message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    command = shlex.join([os.path.relpath(sys.executable), *sys.argv])
    documents = load_documents(args.max_tokens, args.documents, args.seed)
    load_before = os.getloadavg()
    counts = thread_counts or [args.threads]
    limits_before = measure_limits(counts, args.dtype, device)
    results, skipped = [], {}
    for name in args.drafts:
        try:
            results.append(measure(name, args, documents, device, log))
        except NotImplementedError as why:
            skipped[name] = str(why)
            log(f"{name}: skipped: {why}")
    load_after = os.getloadavg()
    limits = best_limits(limits_before, measure_limits(counts, args.dtype, device))
    text = header(args, command, documents, device, (load_before, load_after), counts)
    return Run(results, skipped, limits, text, args.threads, device.type == "cpu")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print(report(run_drafts(args, measure_draft)))


if __name__ == "__main__":
    main()
