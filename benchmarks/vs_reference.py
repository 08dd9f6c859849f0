"""Every draft against NVIDIA NeMo Automodel 0.7.0, the reference the oracle tests load: the same full
training step, timed side by side in one process.

Per draft (EAGLE-3, MLA-EAGLE-3, DFlash, DFlash2, DSpark), both implementations train on:

* the same frozen target object (NeMo's target wrapper holds the project module's own Hugging Face model);
* the same documents in the same micro-batches (the throughput benchmark's workload and layouts: packed
  rows of ``--max-tokens`` and one document per padded row), validated once per step by each side
  (``validate_batch``, the pack);
* the same initial draft weights (NeMo's draft gets the project draft's through the oracle's weight
  mapping, ``benchmarks/nemo_reference.py``), restored with a fresh AdamW at the start of every timed epoch;
* the same anchors: DFlash / DFlash2 take the throughput benchmark's (drawn per document, placed in
  each layout) through the trainer method NeMo samples with; DSpark's draft samples its own, so NeMo's
  sampler draws them (seeded, with the largest per-row count of the throughput anchors as its budget)
  and the project module trains on that draw.

A step is the whole of it: the batch check, the target forward, the draft, the loss, backward, gradient
clipping at 1.0 and AdamW. Time is process CPU time at one thread (``torch.set_num_threads(1)``): on a
shared machine it is what the step cost, whatever else ran. Epochs alternate ours, NeMo's, ours, ... per
layout (interleaved pairs), and the figure is NeMo's CPU time over ours (how many times faster ours is),
median over the pairs with their range. Process CPU time is user-mode and kernel time; the kernel's part is
mostly the page faults on the fresh pages of large allocations, whose cost differs from machine to machine
and from run to run, so the ratio of user-mode time alone is printed beside it, and each side's minor page
faults per epoch (how many is the code's doing; what each costs is the machine's). Before timing, the first
micro-batch of each layout is stepped once by both from the same weights and the two losses printed: equal
losses are what proves equal work.
How many of those faults there are, and the user-mode time they cost through cache misses, depend on glibc's
malloc state too: with its defaults every tensor above its mmap threshold (which moves with what the process
freed before) is fresh pages, and a run of one draft differs from the same draft after others. The header
names the allocator settings (``GLIBC_TUNABLES``); with ``glibc.malloc.mmap_max=0`` and a large
``glibc.malloc.trim_threshold`` both sides reuse their heap and neither faults after its first epoch.
Saved activations (autograd's saved tensors, parameters excluded) are compared per real token.

MLA-EAGLE-3 runs on a DeepSeek-V3-shaped target of the same width (MLA attention, one dense layer then
mixture-of-experts layers); the other drafts share the throughput benchmark's Llama target.

    .venv/bin/python benchmarks/vs_reference.py                      # every draft, 16 documents
    .venv/bin/python benchmarks/vs_reference.py --drafts dflash2 dspark --repeats 2
"""

from __future__ import annotations

import argparse
import os
import resource
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import torch
from torch import Tensor

# The tree this file is in comes first on the path, before anything imports the package (the throughput
# benchmark does): its package and its oracle are the ones measured, whatever tree is installed.
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Run as a script, so its own folder is on the path: the throughput benchmark's workload and drafts,
# reused as is.
import drafts  # noqa: E402
import throughput  # noqa: E402
from nemo_reference import (  # noqa: E402
    Reference,
    dflash_reference,
    dspark_anchors,
    dspark_reference,
    eagle3_reference,
)

from lightning_drafts import DraftModule, MLAEagle3Module  # noqa: E402
from lightning_drafts.core.batch import validate_batch  # noqa: E402
from lightning_drafts.datamodules.embedded import EMBEDDED_VOCAB_SIZE  # noqa: E402

DRAFTS = ("eagle3", "mla_eagle3", "dflash", "dflash2", "dspark")
LAYOUTS = throughput.LAYOUTS
CLIP = 1.0
MIB = 2**20


@dataclass
class Side:
    """One implementation of one draft: its trainable parameters, their initial values, and a step."""

    name: str
    parameters: list[Tensor]
    loss: Callable[[dict[str, Tensor], Tensor | None], Tensor]
    initial: list[Tensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.initial = [p.detach().clone() for p in self.parameters]

    def fresh(self, learning_rate: float) -> torch.optim.Optimizer:
        with torch.no_grad():
            for parameter, value in zip(self.parameters, self.initial, strict=True):
                parameter.copy_(value)
        return torch.optim.AdamW(self.parameters, lr=learning_rate)

    def step(
        self, optimizer: torch.optim.Optimizer, batch: dict[str, Tensor], anchors: Tensor | None
    ) -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = self.loss(batch, anchors)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.parameters, CLIP)
        optimizer.step()
        return float(loss.detach())


@dataclass
class LayoutResult:
    ours_cpu: list[float]
    theirs_cpu: list[float]
    ours_user: list[float]
    theirs_user: list[float]
    ours_faults: list[int]
    theirs_faults: list[int]
    loss_ours: float
    loss_theirs: float
    saved_ours: int
    saved_theirs: int
    real_tokens: int
    blocks_or_slots: str

    def speedups(self) -> list[float]:
        return [t / o for o, t in zip(self.ours_cpu, self.theirs_cpu, strict=True)]

    def user_speedup(self) -> float:
        return statistics.median(self.theirs_user) / statistics.median(self.ours_user)


# --- the workload ----------------------------------------------------------------------------------------


def mla_target_config(args: argparse.Namespace) -> dict[str, Any]:
    """A DeepSeek-V3-shaped target as wide and deep as the throughput benchmark's Llama target."""
    hidden = args.hidden_size
    return {
        "model_type": "deepseek_v3",
        "vocab_size": EMBEDDED_VOCAB_SIZE,
        "hidden_size": hidden,
        "intermediate_size": 3 * hidden,
        "moe_intermediate_size": hidden // 2,
        "num_hidden_layers": args.target_layers,
        "first_k_dense_replace": 1,
        "num_attention_heads": hidden // 64,
        "num_key_value_heads": hidden // 64,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "q_lora_rank": hidden // 2,
        "kv_lora_rank": hidden // 4,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 32,
        "v_head_dim": 64,
        "max_position_embeddings": 4 * args.max_tokens,
        "tie_word_embeddings": False,
    }


def build_module(name: str, args: argparse.Namespace, padded: list[dict[str, Tensor]]) -> DraftModule:
    if name != "mla_eagle3":
        return drafts.build_draft(name, args, padded)
    return drafts.build_eagle3(args, padded, MLAEagle3Module, mla_target_config(args))


def throughput_anchors(
    name: str, module: DraftModule, documents: Any, plans: dict, batches: dict, seed: int
) -> dict[str, list[Tensor | None]]:
    """The throughput benchmark's anchors per layout (None for EAGLE-3)."""
    if name not in drafts.ANCHOR_DRAFTS:
        return {layout: [None] * len(batches[layout]) for layout in LAYOUTS}
    offsets = throughput.document_anchors(module, batches["padded"], plans["padded"], seed)
    return {
        layout: throughput.layout_anchors(offsets, plans[layout], documents.lengths, torch.device("cpu"))
        for layout in LAYOUTS
    }


def allocator_line() -> str:
    """The header line naming glibc's malloc settings (why they matter: the module docstring)."""
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if not tunables:
        return (
            "Allocator: glibc's defaults (tensors above its mmap threshold are fresh pages at every "
            "allocation)."
        )
    return f"Allocator: GLIBC_TUNABLES={tunables}."


def trainable(module: torch.nn.Module) -> list[Tensor]:
    return [p for p in module.parameters() if p.requires_grad]


def sides(
    name: str, module: DraftModule, layout: str, budget: int, seed: int
) -> tuple[Side, Side, Callable[[dict[str, Tensor]], Tensor | None]]:
    """(ours, NeMo's, the DSpark anchors of a batch or None) for one draft and layout."""
    vocab = module.target.vocab_size

    def ours(batch: dict[str, Tensor], anchors: Tensor | None) -> Tensor:
        if anchors is None:
            return module.compute_loss(batch).loss
        return module.compute_loss(batch, anchors=anchors).loss

    reference: Reference
    nemo_anchors = None
    if name in ("eagle3", "mla_eagle3"):
        reference = eagle3_reference(module)
    elif name in ("dflash", "dflash2"):
        reference = dflash_reference(module)
    else:
        reference = dspark_reference(module, num_anchors=budget, seed=seed)

        def nemo_anchors(batch: dict[str, Tensor]) -> Tensor:
            return dspark_anchors(validate_batch(dict(batch), vocab_size=vocab), budget, seed)

    def theirs(batch: dict[str, Tensor], anchors: Tensor | None) -> Tensor:
        return reference.step(validate_batch(dict(batch), vocab_size=vocab), anchors).loss

    ours_side = Side("ours", trainable(module), ours)
    theirs_side = Side("NeMo", trainable(reference.draft), theirs)
    return ours_side, theirs_side, nemo_anchors


def epoch_cpu_seconds(
    side: Side, args: argparse.Namespace, batches: list, anchors: list
) -> tuple[float, float, int]:
    """The epoch's process CPU time, the user-mode part of it and its minor page faults (the rest of the CPU
    time is the kernel's, mostly those faults, on the fresh pages of large allocations: how many is the
    code's, what each costs depends on the machine and the run)."""
    optimizer = side.fresh(args.learning_rate)
    start, faults = os.times(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for batch, batch_anchors in zip(batches, anchors, strict=True):
        side.step(optimizer, batch, batch_anchors)
    stop, faults = os.times(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    user = stop.user - start.user
    return user + stop.system - start.system, user, faults


def saved_bytes(side: Side, batch: dict[str, Tensor], anchors: Tensor | None, learning_rate: float) -> int:
    sink: list[int] = []
    parameters = {p.untyped_storage().data_ptr() for p in side.parameters}
    optimizer = side.fresh(learning_rate)
    with throughput.saved_activation_bytes(parameters, sink):
        side.step(optimizer, batch, anchors)
    return sink[0]


def measure_layout(
    name: str,
    module: DraftModule,
    layout: str,
    batches: list[dict[str, Tensor]],
    anchors: list[Tensor | None],
    args: argparse.Namespace,
    log: Callable[[str], None],
) -> LayoutResult:
    budget = max((int(a.shape[1]) for a in anchors if a is not None), default=0)
    ours, theirs, nemo_anchors = sides(name, module, layout, budget, args.seed)
    if nemo_anchors is not None:
        anchors = [nemo_anchors(batch) for batch in batches]
    # Equal work: from the same weights, the first micro-batch's loss on both sides.
    loss_ours = ours.step(ours.fresh(args.learning_rate), batches[0], anchors[0])
    loss_theirs = theirs.step(theirs.fresh(args.learning_rate), batches[0], anchors[0])
    log(f"{name} {layout}: first-batch loss ours {loss_ours:.7f}, NeMo {loss_theirs:.7f}")
    saved = [saved_bytes(side, batches[0], anchors[0], args.learning_rate) for side in (ours, theirs)]
    ours_cpu, theirs_cpu, ours_user, theirs_user, ours_faults, theirs_faults = [], [], [], [], [], []
    for repeat in range(args.repeats):
        for cpu, user, faults, side in (
            (ours_cpu, ours_user, ours_faults, ours),
            (theirs_cpu, theirs_user, theirs_faults, theirs),
        ):
            total, in_user, minor = epoch_cpu_seconds(side, args, batches, anchors)
            cpu.append(total)
            user.append(in_user)
            faults.append(minor)
        log(
            f"{name} {layout}: pair {repeat + 1}/{args.repeats}: ours {ours_cpu[-1]:.1f} s "
            f"({ours_user[-1]:.1f} user, {ours_faults[-1]:,} minor faults), NeMo {theirs_cpu[-1]:.1f} s "
            f"({theirs_user[-1]:.1f} user, {theirs_faults[-1]:,} minor faults) CPU"
        )
    real = int(batches[0]["attention_mask"].sum())
    if name in drafts.ANCHOR_DRAFTS:
        count = sum(int((a >= 0).sum()) for a in anchors)
        work = f"{count:,} blocks"
    else:
        work = f"{sum(int(b['attention_mask'].sum()) for b in batches):,} real tokens"
    return LayoutResult(
        ours_cpu,
        theirs_cpu,
        ours_user,
        theirs_user,
        ours_faults,
        theirs_faults,
        loss_ours,
        loss_theirs,
        *saved,
        real,
        work,
    )


# --- report ----------------------------------------------------------------------------------------------


def speedup_cell(result: LayoutResult) -> str:
    pairs = result.speedups()
    median = statistics.median(result.theirs_cpu) / statistics.median(result.ours_cpu)
    return f"**{median:.2f}x** ({min(pairs):.2f}-{max(pairs):.2f})"


TABLE_HEAD = [
    "| draft | ours packed / NeMo packed | ours padded / NeMo padded | CPU s per epoch, packed: ours / NeMo "
    "| padded: ours / NeMo | user-mode CPU time only, NeMo / ours (packed; padded) "
    "| minor page faults per epoch, thousands, packed: ours / NeMo; padded: ours / NeMo "
    "| work per epoch (packed; padded) | first-batch loss, max abs difference "
    "| saved activations per real token, NeMo / ours (packed; padded) | first-batch losses, ours / NeMo |",
    "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---|",
]


def faults(result: LayoutResult) -> str:
    """Median minor page faults per epoch, ours / NeMo's, in thousands."""
    ours, theirs = statistics.median(result.ours_faults), statistics.median(result.theirs_faults)
    return f"{ours / 1e3:,.0f} / {theirs / 1e3:,.0f}"


def row(name: str, by_layout: dict[str, LayoutResult]) -> str:
    """One draft's row of the table (printed as soon as the draft is done: a cut-short run keeps it)."""
    packed, padded = by_layout["packed"], by_layout["padded"]
    difference = max(abs(r.loss_ours - r.loss_theirs) for r in by_layout.values())
    losses = "; ".join(f"{layout} {r.loss_ours:.7f} / {r.loss_theirs:.7f}" for layout, r in by_layout.items())
    return (
        f"| {name} | {speedup_cell(packed)} | {speedup_cell(padded)} | "
        f"{statistics.median(packed.ours_cpu):.1f} / {statistics.median(packed.theirs_cpu):.1f} | "
        f"{statistics.median(padded.ours_cpu):.1f} / {statistics.median(padded.theirs_cpu):.1f} | "
        f"{packed.user_speedup():.2f}x; {padded.user_speedup():.2f}x | {faults(packed)}; {faults(padded)} | {packed.blocks_or_slots}; {padded.blocks_or_slots} | {difference:.1e} | "
        f"{packed.saved_theirs / packed.saved_ours:.2f}x; {padded.saved_theirs / padded.saved_ours:.2f}x | {losses} |"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--drafts", nargs="+", choices=DRAFTS, default=list(DRAFTS))
    parser.add_argument("--pairs", type=int, default=3, help="interleaved (ours, NeMo) epochs per layout")
    ours, rest = parser.parse_known_args(argv)
    # The workload options (documents, widths, TTT length, block size, anchors...) are the throughput
    # benchmark's; 16 documents make one packed micro-batch.
    args = throughput.parse_args(["--documents", "16", *rest])
    args.repeats = ours.pairs
    datasets.disable_progress_bars()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)

    def log(message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    command = shlex.join([os.path.relpath(sys.executable), *sys.argv])
    load_before = os.getloadavg()
    documents = throughput.load_documents(args.max_tokens, args.documents, args.seed)
    target = drafts.target_config(args)
    header = [
        f"Command: `{command}`",
        "",
        f"torch {torch.__version__}, CPU, 1 thread, float32; NeMo Automodel 0.7.0; load average (1/5/15 min) "
        f"{'/'.join(f'{x:.1f}' for x in load_before)} at the start.",
        allocator_line(),
        f"Documents: {len(documents)} of the embedded corpus (seed {args.seed}), {documents.num_tokens:,} tokens, "
        f"truncated to {args.max_tokens}; micro-batch {args.micro_batch} rows of {args.max_tokens} (packed) / "
        f"{args.micro_batch} documents (padded); {args.repeats} interleaved (ours, NeMo) epochs per layout.",
        f"Target: Llama, hidden {target['hidden_size']}, MLP {target['intermediate_size']}, "
        f"{target['num_hidden_layers']} layers, vocabulary {target['vocab_size']} (MLA-EAGLE-3: DeepSeek-V3 "
        f"of the same width and depth). EAGLE-3: ttt_length {args.ttt_length}, draft vocabulary "
        f"{args.draft_vocab_size}. Block drafts: {args.draft_layers} layers, block {args.block_size}, "
        f"{args.anchors} anchors per document (DSpark: NeMo's own draw, as many per row).",
        "Speed-ups are NeMo's CPU time over ours, median of the pairs (range of the pairs).",
    ]
    print("\n".join([*header, "", *TABLE_HEAD]), flush=True)
    for name in ours.drafts:
        plans = {
            layout: throughput.plan(documents, layout, args.max_tokens, args.micro_batch, args.seed)
            for layout in LAYOUTS
        }
        batches = {
            layout: throughput.collate_all(documents, plans[layout], torch.device("cpu"))
            for layout in LAYOUTS
        }
        module = build_module(name, args, batches["padded"])
        anchors = throughput_anchors(name, module, documents, plans, batches, args.seed)
        results = {
            layout: measure_layout(name, module, layout, batches[layout], anchors[layout], args, log)
            for layout in LAYOUTS
        }
        print(row(name, results), flush=True)
        del module
    print(f"\nLoad average (1/5/15 min) at the end: {'/'.join(f'{x:.1f}' for x in os.getloadavg())}.")


if __name__ == "__main__":
    main()
