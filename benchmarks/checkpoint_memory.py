"""Peak host memory of one checkpoint save with full state dicts on 2 CPU processes (gloo): under FSDP2
(``ModelParallelStrategy(save_distributed_checkpoint=False)``, the target's decoder layers sharded) or FSDP1
(``FSDPStrategy(state_dict_type="full")``, the target's decoder layers its FSDP units, as the FSDP1 recipe).

A DFlash draft (one layer) trains one step against a random Qwen3 target whose embedding and untied LM head
dominate its size (``--vocab`` x ``--hidden`` each, float32); then rank 0 resets its peak resident set
(``echo 5 > /proc/self/clear_refs``), calls ``trainer.save_checkpoint`` and reads ``VmHWM`` of
``/proc/self/status``: the save's peak above the resident set just before it. Also reported: the bytes of
the target's tensors the strategy's state dict holds (what a save gathers to rank 0 and drops), and the
file's size. Run it on two trees to compare them (``PYTHONPATH=<tree>``):

    .venv/bin/python benchmarks/checkpoint_memory.py --strategy fsdp2
    .venv/bin/python benchmarks/checkpoint_memory.py --strategy fsdp1

On a CPU, FSDP2 hands the unsharded target tensors (embedding, final norm, LM head) to the state dict by
reference (its ``cpu_offload`` copy is a no-op there), so the bytes it holds are what a GPU would copy to
the host; FSDP1 unshards its root unit's flat parameter and clones each parameter out of it on a CPU too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

MIB = 2**20


def status_kib(field: str) -> int:
    with open("/proc/self/status") as lines:
        for line in lines:
            key, value = line.split(":", 1)
            if key == field:
                return int(value.split()[0])
    raise ValueError(f"/proc/self/status has no {field} line; this benchmark needs Linux")


def main(args: argparse.Namespace) -> None:
    import torch
    from two_process import trainer as two_process_trainer

    from lightning_drafts import DFlashModule

    torch.manual_seed(0)
    target = {
        "model_type": "qwen3",
        "vocab_size": args.vocab,
        "hidden_size": args.hidden,
        "intermediate_size": 2 * args.hidden,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": args.hidden // 4,
        "tie_word_embeddings": False,
    }
    module = DFlashModule(
        target,
        mask_token_id=3,
        num_draft_layers=1,
        block_size=4,
        num_anchors=4,
        # In one piece: before the target's LM head was kept out of FSDP1's root flat parameter, the
        # chunked terms refused it there (a view of a trainable flat parameter).
        logits_chunk_blocks=None,
        shard_target=args.strategy == "fsdp2",
    )
    decoder = {id(p) for p in module.target.decoder_layers.parameters()}
    outside_decoder = sum(
        p.numel() * p.element_size() for p in module.target.parameters() if id(p) not in decoder
    )
    width = 64
    rows = [
        {
            "input_ids": torch.randint(4, args.vocab, (width,)),
            "attention_mask": torch.ones(width, dtype=torch.long),
            "loss_mask": torch.ones(width, dtype=torch.long),
        }
        for _ in range(4)
    ]
    # The 2-process trainer of the FSDP1 / FSDP2 tests (FSDP1: the target's decoder layers its units).
    trainer = two_process_trainer(args.strategy, 1, [])
    trainer.fit(module, torch.utils.data.DataLoader(rows, batch_size=1))
    state = trainer.strategy.lightning_module_state_dict()
    target_bytes = sum(
        value.numel() * value.element_size() for key, value in state.items() if key.startswith("target.")
    )
    del state
    path = Path(args.out) / "save.ckpt"
    if trainer.is_global_zero:
        Path("/proc/self/clear_refs").write_text("5")
    before = status_kib("VmRSS")
    trainer.save_checkpoint(path)
    peak = status_kib("VmHWM")
    if trainer.is_global_zero:
        result = {
            "save_peak_above_rss_mib": round((peak - before) / 1024, 1),
            "target_bytes_in_state_dict_mib": round(target_bytes / MIB, 1),
            "target_outside_decoder_mib": round(outside_decoder / MIB, 1),
            "checkpoint_mib": round(path.stat().st_size / MIB, 1),
            "strategy": args.strategy,
            "vocab": args.vocab,
            "hidden": args.hidden,
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
        }
        print(json.dumps(result))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=("fsdp2", "fsdp1"), default="fsdp2")
    parser.add_argument("--vocab", type=int, default=65536)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--out", default=None, help="folder for the checkpoint (default: a temporary one)")
    parsed = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        parsed.out = parsed.out or scratch
        main(parsed)
    sys.exit(0)
