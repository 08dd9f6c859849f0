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

The target is a Llama-shaped random model whose width makes its linear layers dominate, with the
embedded tokenizer's 32,000-token vocabulary. EAGLE-3 trains a 4,096-token draft vocabulary; the
target's LM-head rows outside it are zeroed so the random teacher's greedy token lands inside it, as a
trained target's does (otherwise 7 positions in 8 would leave the loss and the benchmark would skip the
draft's LM-head work).

EAGLE-3 runs each TTT step only at the slots with a supervised prediction left (``ttt_live_slots_only``,
the default; step 0's keys and values still run at every slot). ``--eagle3-all-slots`` also times every slot at every step (the path before it), interleaved
with the default in the same process, and reports live / all slots per layout, the saved activations of
both, and the least-squares fit ``epoch time = a * token slots + b * live slot-steps + c * supervised``
over the four runs (live slot-steps: the (slot, step) pairs whose query side runs, every one of them
without the skip; step 0's keys and values run at every slot either way).

The block drafts draft only the blocks with a supervised chain position and project only the supervised
chain positions onto the vocabulary (``block_valid_only``, the default). ``--block-all-slots`` also times
every block at every chain position (the path before it), interleaved with the default in the same
process, and reports skip / all per layout with the chain positions projected and the blocks drafted on
each path, and the saved activations of both.

``--thread-scaling 1 2`` times only the packed layout of each draft, once per thread count
(``torch.set_num_threads`` between interleaved epochs of one process), and reports wall and CPU time at
each count, their ratios to the first, and the load average at the end of every epoch: on a shared
machine the 2-thread wall time depends on what else runs.

    .venv/bin/python benchmarks/throughput.py --documents 16          # a few minutes on 2 CPU cores
    .venv/bin/python benchmarks/throughput.py --drafts eagle3 --eagle3-all-slots
    .venv/bin/python benchmarks/throughput.py --drafts dflash dflash2 dspark --block-all-slots
    .venv/bin/python benchmarks/throughput.py --documents 16 --thread-scaling 1 2
    .venv/bin/python benchmarks/throughput.py --device cuda --documents 512
"""

from __future__ import annotations

import argparse
import ctypes
import inspect
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import datasets
import numpy as np
import torch
from model_flops import MatmulRate, counted_flops, matmul_rate
from torch import Tensor

from lightning_drafts import DFlash2Module, DFlashModule, DraftModule, Eagle3Module
from lightning_drafts.attention.anchors import anchors_from_positions
from lightning_drafts.attention.block_masks import block_layout
from lightning_drafts.blockdraft.objective import block_targets
from lightning_drafts.core.batch import PackedBatch
from lightning_drafts.datamodules import PackedChatDataModule
from lightning_drafts.datamodules.documents import Documents
from lightning_drafts.datamodules.embedded import EMBEDDED_PAD_TOKEN_ID, EMBEDDED_VOCAB_SIZE
from lightning_drafts.datamodules.packing import MicroBatchPlan, collate, plan_epoch
from lightning_drafts.dspark.eval_mask import block_supervision
from lightning_drafts.eagle3 import count_supervised_tokens
from lightning_drafts.eagle3.live_slots import live_slots
from lightning_drafts.eagle3.ttt import ttt_supervision

LAYOUTS = ("packed", "padded")
# EAGLE-3 without the live-slot skip, timed beside the default under --eagle3-all-slots.
ALL_SLOTS = ", all slots"
# Block drafts without the supervised-position skip, timed beside the default under --block-all-slots.
ALL_POSITIONS = ", all positions"
ANCHOR_DRAFTS = ("dflash", "dflash2", "dspark")
ALL_DRAFTS = ("eagle3", *ANCHOR_DRAFTS)
# Id 0 is <unk>: SentencePiece's byte fallback never emits it, so no document holds it (it also pads,
# which only matters to serving, not to a throughput measurement).
MASK_TOKEN_ID = 0


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
    ``--threads``)."""

    name: str
    layout: str
    skip: bool = True
    threads: int | None = None


def series_of(name: str, args: argparse.Namespace) -> list[Series]:
    if args.thread_scaling:
        return [
            Series(f"packed, {n} thread{'s' * (n > 1)}", "packed", threads=n) for n in args.thread_scaling
        ]
    series = [Series(layout, layout) for layout in LAYOUTS]
    if name == "eagle3" and args.eagle3_all_slots:
        series += [Series(layout + ALL_SLOTS, layout, skip=False) for layout in LAYOUTS]
    if name in ANCHOR_DRAFTS and args.block_all_slots:
        series += [Series(layout + ALL_POSITIONS, layout, skip=False) for layout in LAYOUTS]
    return series


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


# --- drafts ----------------------------------------------------------------------------------------


def target_config(args: argparse.Namespace) -> dict[str, Any]:
    """A Llama-shaped target wide enough that its linear layers dominate, with the tokenizer's vocabulary."""
    hidden = args.hidden_size
    return {
        "model_type": "llama",
        "vocab_size": EMBEDDED_VOCAB_SIZE,
        "hidden_size": hidden,
        "intermediate_size": 3 * hidden,
        "num_hidden_layers": args.target_layers,
        "num_attention_heads": hidden // 64,
        "num_key_value_heads": max(1, hidden // 256),
        "head_dim": 64,
        "max_position_embeddings": 4 * args.max_tokens,
        "tie_word_embeddings": False,
    }


def capture_layers(num_layers: int, count: int) -> list[int]:
    """``count`` distinct ascending layer ids spread over the target (the defaults need deeper targets)."""
    if num_layers < count:
        raise ValueError(f"--target-layers {num_layers} is fewer than the {count} captured layers needed")
    return np.linspace(0, num_layers - 1, count).round().astype(int).tolist()


def build_eagle3(args: argparse.Namespace, documents: list[dict[str, Tensor]]) -> DraftModule:
    counts = count_supervised_tokens(documents, EMBEDDED_VOCAB_SIZE)
    module = Eagle3Module(
        target_config(args),
        target_layer_ids=capture_layers(args.target_layers, 3),
        ttt_length=args.ttt_length,
        draft_vocab_size=args.draft_vocab_size,
        token_frequencies=counts,
    )
    # A random target's greedy token is uniform over 32,000 ids and would leave the draft vocabulary
    # 7 times in 8, dropping those positions from the loss; a trained target's stays inside it about as
    # often as the vocabulary covers the data (here 100%). Silencing the other LM-head rows restores that,
    # so the logits and loss work per supervised position is what real training does.
    with torch.no_grad():
        keep = torch.zeros(EMBEDDED_VOCAB_SIZE, dtype=torch.bool)
        keep[module.draft.selected_token_ids] = True
        module.target.lm_head.weight[~keep] = 0.0
    return module


def block_draft_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """The block drafts' shared arguments; ``logits_chunk_blocks`` only when asked (else each default)."""
    arguments = {
        "mask_token_id": MASK_TOKEN_ID,
        "target_layer_ids": capture_layers(args.target_layers, min(args.draft_layers, args.target_layers)),
        "num_draft_layers": args.draft_layers,
        "block_size": args.block_size,
        "num_anchors": args.anchors,
    }
    if args.logits_chunk_blocks is not None:
        arguments["logits_chunk_blocks"] = args.logits_chunk_blocks or None
    return arguments


def build_block_draft(cls: type[DraftModule], args: argparse.Namespace) -> DraftModule:
    return cls(target_config(args), **block_draft_arguments(args))


def build_dspark(args: argparse.Namespace) -> DraftModule:
    """DSpark, once ``lightning_drafts`` exports it; only the arguments its constructor takes are passed."""
    try:
        from lightning_drafts import DSparkModule
    except ImportError as error:
        raise NotImplementedError(f"DSparkModule is not importable yet ({error})") from error
    accepted = inspect.signature(DSparkModule.__init__).parameters
    wanted = block_draft_arguments(args)
    return DSparkModule(target_config(args), **{k: v for k, v in wanted.items() if k in accepted})


def build_draft(name: str, args: argparse.Namespace, padded: list[dict[str, Tensor]]) -> DraftModule:
    if name == "eagle3":
        return build_eagle3(args, padded)
    if name == "dflash":
        return build_block_draft(DFlashModule, args)
    if name == "dflash2":
        return build_block_draft(DFlash2Module, args)
    return build_dspark(args)


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
    live_slot_steps: dict[str, int] = field(default_factory=dict)
    # Block drafts, per layout: chain positions, supervised ones, blocks, blocks with a supervised position.
    chain_work: dict[str, ChainWork] = field(default_factory=dict)
    setup_note: str = ""
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


@torch.no_grad()
def live_slot_steps(module: DraftModule, batches: list[dict[str, Tensor]]) -> int:
    """The (slot, step) pairs whose query side EAGLE-3 computes over ``batches`` with the skip (untimed)."""
    total = 0
    for batch in batches:
        packed = module.prepare_batch(batch)
        supervision = ttt_supervision(packed, module.teacher_signal(packed), module.hparams.ttt_length)
        total += sum(slots.numel() for slots in live_slots(supervision.supervised))
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


def epoch_flops(module: DraftModule, fresh: FreshStart, workload: Workload, run: Series, name: str) -> int:
    """Model FLOPs of one (untimed) epoch of ``run``: FlopCounterMode over every step (model_flops.py)."""
    pairs = list(zip(workload.batches[run.layout], workload.anchors[run.layout], strict=True))
    with configured(module, run):
        optimizer = fresh()

        def epoch() -> None:
            for batch, anchors in pairs:
                train_step(module, optimizer, batch, anchors, name)

        return counted_flops(epoch)


def measure_draft(
    name: str,
    args: argparse.Namespace,
    documents: Documents,
    device: torch.device,
    log: Callable[[str], None],
) -> DraftResult:
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
    workload = Workload(batches=batches, anchors=anchors)
    fresh = FreshStart(module, args.learning_rate)
    memory = PeakMemory(device)
    series = series_of(name, args)

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
    steps = {}
    if name == "eagle3" and not args.thread_scaling:
        width = args.ttt_length
        steps = {run.name: width * workload.slots(run.layout) for run in series if not run.skip}
        steps |= {run.name: live_slot_steps(module, batches[run.layout]) for run in series if run.skip}
    work = {}
    if name in ANCHOR_DRAFTS:
        work = {
            layout: chain_work(module, batches[layout], anchors[layout], name == "dspark")
            for layout in LAYOUTS
        }
    return DraftResult(
        name=name,
        workload=workload,
        epochs=epochs,
        micro_batches={layout: len(batches[layout]) for layout in LAYOUTS},
        series=series,
        live_slot_steps=steps,
        chain_work=work,
        flops=flops,
    )


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


def all_slots_section(result: DraftResult, cpu: bool) -> list[str]:
    """EAGLE-3 with the live-slot skip against every slot at every step, and the linear time fit."""
    if result.name != "eagle3" or all(run.skip for run in result.series):
        return []
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
            f"| {layout} |{skip_cells(result, layout, every, cpu)} "
            f"{result.live_slot_steps[layout]:,} / {result.live_slot_steps[every]:,} | "
            f"{saved_per_1k(result, layout):.0f} / {saved_per_1k(result, every):.0f} |"
        )
    # On CPU the fit takes process CPU time: on a shared machine the wall time is mostly other processes'.
    lines += ["", *time_fit(result, "cpu_seconds" if cpu else "seconds")]
    return lines


def all_positions_section(result: DraftResult, cpu: bool) -> list[str]:
    """A block draft with the supervised-block / position skip against every block and position."""
    if result.name not in ANCHOR_DRAFTS or all(run.skip for run in result.series):
        return []
    cpu_head, cpu_rule = (" skip / all by CPU time |", "---:|") if cpu else ("", "")
    lines = [
        "",
        f"{result.name}, supervised blocks and chain positions only (default) vs every block and position "
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
            f"| {layout} |{skip_cells(result, layout, every, cpu)} {work.supervised:,} / {work.positions:,} | "
            f"{work.supervised_blocks:,} / {work.blocks:,} | "
            f"{saved_per_1k(result, layout):.0f} / {saved_per_1k(result, every):.0f} |"
        )
    return lines


def time_fit(result: DraftResult, clock: str) -> list[str]:
    """Least squares ``median epoch time = a * token slots + b * live slot-steps + c * supervised`` (by
    ``clock``: ``"seconds"`` or ``"cpu_seconds"``) over the timed series, with each term's share of every
    series' fitted time."""
    names = [run.name for run in result.series]
    features = np.array(
        [
            [
                result.workload.slots(result.layout(name)),
                result.live_slot_steps[name],
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


def report(
    results: list[DraftResult],
    skipped: dict[str, str],
    cpu: bool,
    header: str,
    limits: dict[int, MatmulRate],
    threads: int,
    thread_scaling: list[int] | None = None,
) -> str:
    if thread_scaling:
        lines = [header, "", *thread_scaling_report(results, thread_scaling)]
        lines += flops_section(results, limits, threads, cpu)
        return "\n".join(lines + [f"\n{name}: skipped: {why}" for name, why in skipped.items()])
    cpu_head, cpu_rule = (" packed/padded by CPU time |", "---:|") if cpu else ("", "")
    lines = [
        header,
        "",
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
    for result in results:
        lines += all_slots_section(result, cpu)
        lines += all_positions_section(result, cpu)
    lines += flops_section(results, limits, threads, cpu)
    lines += [f"\n{name}: skipped: {why}" for name, why in skipped.items()]
    return "\n".join(lines)


# --- command line ----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
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
    parser.add_argument(
        "--eagle3-all-slots",
        action="store_true",
        help="also time EAGLE-3 with every slot at every TTT step (ttt_live_slots_only=False), interleaved",
    )
    parser.add_argument(
        "--block-all-slots",
        action="store_true",
        help="also time the block drafts with every block at every chain position (block_valid_only=False), "
        "interleaved",
    )
    parser.add_argument(
        "--thread-scaling",
        type=int,
        nargs="+",
        default=None,
        metavar="THREADS",
        help="time only the packed layout, once per thread count (e.g. 1 2), interleaved in one process",
    )
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
    args = parser.parse_args(argv)
    if args.warmup is None:
        args.warmup = -1 if args.device == "cuda" else 1
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    args.dtype = getattr(torch, args.dtype)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
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
    counts = args.thread_scaling or [args.threads]
    limits_before = measure_limits(counts, args.dtype, device)
    results, skipped = [], {}
    for name in args.drafts:
        try:
            results.append(measure_draft(name, args, documents, device, log))
        except NotImplementedError as why:
            skipped[name] = str(why)
            log(f"{name}: skipped: {why}")
    load_after = os.getloadavg()
    limits = best_limits(limits_before, measure_limits(counts, args.dtype, device))

    target = target_config(args)
    header = "\n".join(
        [
            f"Command: `{command}`",
            "",
            f"torch {torch.__version__}, device {device}"
            + (
                f" ({torch.cuda.get_device_name(device)})"
                if device.type == "cuda"
                else f", {'/'.join(map(str, args.thread_scaling)) if args.thread_scaling else args.threads} threads"
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
    print(report(results, skipped, device.type == "cpu", header, limits, args.threads, args.thread_scaling))


if __name__ == "__main__":
    main()
