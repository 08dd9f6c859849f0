"""DFlash's frozen target run only through its deepest fused layer, against the whole target.

DFlash and DFlash2 read the outputs of ``target_layer_ids`` and no final state, so the target's forward
stops at the deepest of them (its default spread ``1 .. L - 3`` leaves the last two layers and the final
norm out). This times one packed DFlash training step (target forward, draft, loss, backward, AdamW) both
ways on the throughput benchmark's workload and target, made ``--target-layers`` deep, with the default
layer spread for ``--draft-layers``: the module as it is, and the same module (same weights, anchors and
batches) whose target runs whole. Process CPU time at one thread, the two interleaved ``--pairs`` times;
the losses of the two are printed, equal bit for bit (the fused layers are computed the same way).

    .venv/bin/python benchmarks/target_depth.py                      # 12 layers, 2 draft layers: [1, 9]
    .venv/bin/python benchmarks/target_depth.py --target-layers 36 --draft-layers 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import datasets

# Run as a script, so its own folder is on the path: the throughput benchmark's workload and drafts,
# reused as is.
import drafts
import throughput
import torch

from lightning_drafts import DFlashModule
from lightning_drafts.core.batch import PackedBatch
from lightning_drafts.training.target import TargetOutput


class WholeTargetDFlash(DFlashModule):
    """DFlash whose target runs every layer and the final norm (what a forward without the stop costs)."""

    def target_output(
        self, packed: PackedBatch, layer_ids: Sequence[int], final: bool = True
    ) -> TargetOutput:
        return super().target_output(packed, layer_ids, final=True)


def epoch(
    module: DFlashModule, optimizer: torch.optim.Optimizer, batches: list, anchors: list
) -> tuple[float, list]:
    start, losses = time.process_time(), []
    for batch, batch_anchors in zip(batches, anchors, strict=True):
        optimizer.zero_grad(set_to_none=True)
        loss = module.compute_loss(batch, anchors=batch_anchors).loss
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return time.process_time() - start, losses


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=3, help="interleaved (stopped, whole) epochs")
    ours, rest = parser.parse_known_args(argv)
    args = throughput.parse_args(["--documents", "8", "--target-layers", "12", *rest])
    datasets.disable_progress_bars()
    torch.set_num_threads(1)
    documents = throughput.load_documents(args.max_tokens, args.documents, args.seed)
    plan = throughput.plan(documents, "packed", args.max_tokens, args.micro_batch, args.seed)
    batches = throughput.collate_all(documents, plan, torch.device("cpu"))
    arguments = {
        "mask_token_id": drafts.MASK_TOKEN_ID,
        "num_draft_layers": args.draft_layers,
        "block_size": args.block_size,
        "num_anchors": args.anchors,
    }
    modules = {
        "through the deepest fused layer": DFlashModule(drafts.target_config(args), **arguments),
        "whole target": WholeTargetDFlash(drafts.target_config(args), **arguments),
    }
    stopped = modules["through the deepest fused layer"]
    anchors = [
        stopped.sample_anchors(batch, torch.Generator().manual_seed(i)) for i, batch in enumerate(batches)
    ]
    initial = {
        name: [p.detach().clone() for p in module.parameters() if p.requires_grad]
        for name, module in modules.items()
    }
    print(
        f"torch {torch.__version__}, CPU, 1 thread; Llama target {args.target_layers} layers, hidden "
        f"{args.hidden_size}; DFlash {args.draft_layers} draft layers, target_layer_ids "
        f"{stopped.target_layer_ids}; {len(documents)} documents, {len(batches)} packed micro-batch(es)"
    )
    times: dict[str, list[float]] = {name: [] for name in modules}
    losses: dict[str, list[float]] = {}
    for _ in range(ours.pairs + 1):  # the first pair warms up, untimed
        for name, module in modules.items():
            with torch.no_grad():
                trainable = [p for p in module.parameters() if p.requires_grad]
                for parameter, value in zip(trainable, initial[name], strict=True):
                    parameter.copy_(value)
            optimizer = torch.optim.AdamW(trainable, lr=args.learning_rate)
            seconds, losses[name] = epoch(module, optimizer, batches, anchors)
            times[name].append(seconds)
    for name in modules:
        timed = times[name][1:]
        print(
            f"{name}: CPU s per epoch {statistics.median(timed):.2f} ({', '.join(f'{t:.2f}' for t in timed)}), "
            f"losses {losses[name]}"
        )
    whole, stop = (
        statistics.median(times[name][1:]) for name in ("whole target", "through the deepest fused layer")
    )
    print(f"whole / stopped: {whole / stop:.2f}x")


if __name__ == "__main__":
    main()
