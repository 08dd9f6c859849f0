"""How much of the block drafts' vocabulary work lands on unsupervised chain positions.

A block draft projects every chain position (a block slot that predicts a token: ``block_size - 1`` per
DFlash / DFlash2 block, ``block_size`` per DSpark block) onto the full vocabulary; the positions without
supervision only get weight 0. This counts, over the anchors each draft samples:

* on the throughput benchmark's workload (``benchmarks/throughput.py``: its documents, packed
  micro-batches and fixed anchors), and
* on the quickstart configs' data (``configs/quickstart/{dflash,dflash2,dspark}.yaml``: the embedded
  corpus with the shipped tokenizer, ``max_tokens`` and ``batch_size`` of the config, one training epoch,
  anchors drawn by the global RNG seeded with ``seed_everything``),

the chain positions, the unsupervised ones, and the blocks without any supervised position. With
``--timing`` it also times, on the benchmark's first packed micro-batch, a whole training step and the
vocabulary piece alone (the objective's chunked LM-head / loss terms, forward and backward, from the
draft's slot states), with the module's ``block_valid_only`` on and off.

    .venv/bin/python benchmarks/block_supervision.py --threads 1
    .venv/bin/python benchmarks/block_supervision.py --timing --threads 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets

# Run as a script, so its own folder is on the path: the throughput benchmark's workload and drafts,
# reused as is.
import drafts
import skip_ablation
import throughput
import torch
import yaml
from torch import Tensor

from lightning_drafts.attention.anchors import sample_anchors
from lightning_drafts.attention.block_masks import block_layout
from lightning_drafts.blockdraft.objective import block_targets
from lightning_drafts.core.batch import validate_batch
from lightning_drafts.datamodules import PackedChatDataModule
from lightning_drafts.dspark.context_features import context_features, hooked_layer_ids
from lightning_drafts.dspark.eval_mask import block_supervision

ROOT = Path(__file__).resolve().parents[1]
QUICKSTARTS = ("dflash", "dflash2", "dspark")


@dataclass
class Counts:
    blocks: int = 0
    empty_blocks: int = 0
    positions: int = 0
    supervised: int = 0

    def add(self, valid: Tensor) -> None:
        self.blocks += valid.shape[0]
        self.empty_blocks += int((~valid.any(dim=1)).sum())
        self.positions += valid.numel()
        self.supervised += int(valid.sum())

    def row(self, name: str) -> str:
        unsupervised = self.positions - self.supervised
        return (
            f"| {name} | {self.blocks:,} | {self.empty_blocks:,} ({self.empty_blocks / max(self.blocks, 1):.1%}) "
            f"| {self.positions:,} | {unsupervised:,} ({unsupervised / max(self.positions, 1):.1%}) |"
        )


def benchmark_workload(
    name: str, args: argparse.Namespace, documents
) -> tuple[Any, list[dict], list[Tensor]]:
    """The throughput benchmark's draft ``name``, its packed micro-batches and their fixed anchors."""
    plans = {
        layout: throughput.plan(documents, layout, args.max_tokens, args.micro_batch, args.seed)
        for layout in throughput.LAYOUTS
    }
    padded = throughput.collate_all(documents, plans["padded"], torch.device("cpu"))
    packed = throughput.collate_all(documents, plans["packed"], torch.device("cpu"))
    module = drafts.build_draft(name, args, padded)
    offsets = throughput.document_anchors(module, padded, plans["padded"], args.seed)
    anchors = throughput.layout_anchors(offsets, plans["packed"], documents.lengths, torch.device("cpu"))
    return module, packed, anchors


def benchmark_counts(args: argparse.Namespace) -> list[str]:
    documents = throughput.load_documents(args.max_tokens, args.documents, args.seed)
    lines = []
    for name in drafts.ANCHOR_DRAFTS:
        module, packed, anchors = benchmark_workload(name, args, documents)
        counts = Counts()
        for batch, batch_anchors in zip(packed, anchors, strict=True):
            packed_batch = module.prepare_batch(batch)
            counts.add(
                skip_ablation.chain_valid(packed_batch, batch_anchors, args.block_size, name == "dspark")
            )
        lines.append(counts.row(f"benchmark, {name}"))
    return lines


def quickstart_counts(name: str) -> str:
    config = yaml.safe_load((ROOT / "configs" / "quickstart" / f"{name}.yaml").read_text())
    model, data = config["model"]["init_args"], config["data"]["init_args"]
    datamodule = PackedChatDataModule(**data, setup_summary=False)
    datamodule.setup("fit")
    torch.manual_seed(config.get("seed_everything", 0))
    dspark = name == "dspark"
    block_size = model["block_size"]
    counts = Counts()
    for batch in datamodule.train_dataloader():
        packed = validate_batch(batch)
        anchors = sample_anchors(packed, block_size, model["num_anchors"], partial_blocks=dspark)
        counts.add(skip_ablation.chain_valid(packed, anchors, block_size, dspark))
    return counts.row(f"quickstart, {name} (block {block_size}, {model['num_anchors']} anchors)")


def vocabulary_piece(module, batch: dict, anchors: Tensor, name: str) -> float:
    """Process CPU time of the objective's vocabulary terms, forward and backward, from fixed slot states
    (the module's own steps of ``compute_loss``, the draft's forward run beforehand without gradients)."""
    packed = module.prepare_batch(batch)
    layout = block_layout(packed, anchors, module.block_size)
    with torch.no_grad():
        if name == "dspark":
            output = module.target_output(
                packed, hooked_layer_ids(module.target_layer_ids, module.target.num_layers)
            )
            features = context_features(output, module.target, packed, module.target_layer_ids)
            hidden = module._draft_hidden(packed, layout, features)
            supervision = block_supervision(packed, layout)
            teacher = output.final_states(
                (layout.rows[:, None], supervision.teacher_positions), needed=supervision.valid
            )
        else:
            known = torch.ones_like(layout.anchors)
            hidden = module._draft_hidden(packed, layout, known)
            targets = block_targets(packed, layout, known)
    hidden.requires_grad_(True)
    start = time.process_time()
    if name == "dspark":
        result = module._objective(hidden, supervision, teacher)
    else:
        result = module._objective(packed, layout, hidden, targets)
    result.loss.backward()
    return time.process_time() - start


def timing(args: argparse.Namespace, repeats: int) -> list[str]:
    documents = throughput.load_documents(args.max_tokens, args.documents, args.seed)
    lines = [
        "| draft | block_valid_only | step CPU s (median) | vocabulary piece CPU s (median) | piece / step |",
        "|---|---|---:|---:|---:|",
    ]
    for name in drafts.ANCHOR_DRAFTS:
        module, packed, anchors = benchmark_workload(name, args, documents)
        anchors = anchors[0]
        optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-12)
        settings = (True, False) if "block_valid_only" in module.hparams else (None,)
        times: dict[object, tuple[list[float], list[float]]] = {s: ([], []) for s in settings}
        for repeat in range(repeats + 1):
            for setting in settings:
                if setting is not None:
                    module.hparams.block_valid_only = setting
                start = time.process_time()
                throughput.train_step(module, optimizer, packed[0], anchors, name)
                step = time.process_time() - start
                piece = vocabulary_piece(module, packed[0], anchors, name)
                if repeat:  # the first round warms up
                    times[setting][0].append(step)
                    times[setting][1].append(piece)
        for setting, (steps, pieces) in times.items():
            step, piece = statistics.median(steps), statistics.median(pieces)
            lines.append(f"| {name} | {setting} | {step:.2f} | {piece:.2f} | {piece / step:.0%} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--timing", action="store_true", help="also time a step and its vocabulary piece")
    parser.add_argument("--timing-repeats", type=int, default=3)
    ours, rest = parser.parse_known_args()
    args = throughput.parse_args(rest)
    datasets.disable_progress_bars()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    print(
        f"torch {torch.__version__}; load average {'/'.join(f'{x:.1f}' for x in os.getloadavg())} at the start"
    )
    lines = [
        "| workload | blocks | blocks without a supervised position | chain positions | unsupervised positions |",
        "|---|---:|---:|---:|---:|",
        *benchmark_counts(args),
        *(quickstart_counts(name) for name in QUICKSTARTS),
    ]
    print("\n".join(lines))
    if ours.timing:
        print("\n".join(["", *timing(args, ours.timing_repeats)]))
    print(f"load average {'/'.join(f'{x:.1f}' for x in os.getloadavg())} at the end")


if __name__ == "__main__":
    main()
