"""Peak host memory of building a draft module with ``target_decoder: true`` vs ``false``.

A random Llama target (``--hidden``, ``--layers``, ...) is saved to disk in float32; each case builds an
``Eagle3Module`` on it in a fresh subprocess and reports the process' peak resident set (``VmHWM`` of
``/proc/self/status``) before and after the build, and after reading every weight the target holds once
(what its first forward or a copy to the GPU does). With the checkpoint's own dtype ``from_pretrained``
leaves the weights mapped from the file, unread until used; ``target_dtype: bfloat16`` converts them at
load (copied out of the map).

    .venv/bin/python benchmarks/target_memory.py --hidden 1024 --layers 8
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MIB = 1024


def status() -> dict[str, int]:
    """VmHWM / VmRSS / RssAnon / RssFile of this process, in MiB."""
    fields = {}
    with open("/proc/self/status") as lines:
        for line in lines:
            key, value = line.split(":", 1)
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
                fields[key] = int(value.split()[0]) // MIB
    return fields


def child(path: str, decoder: bool, dtype: str | None) -> None:
    import torch

    from lightning_drafts import Eagle3Module

    torch.set_num_threads(1)
    before = status()
    start = time.perf_counter()
    module = Eagle3Module(target=path, target_decoder=decoder, target_dtype=dtype, draft_vocab_size=1024)
    seconds = time.perf_counter() - start
    target_params = sum(p.numel() for p in module.target.parameters())
    after = status()
    # What a first forward or a copy to the device does: read every weight the target holds.
    for parameter in module.target.parameters():
        parameter.sum()
    read = status()
    print(
        json.dumps(
            {
                "before": before,
                "after": after,
                "read": read,
                "seconds": seconds,
                "target_params": target_params,
            }
        )
    )


def save_target(directory: Path, hidden: int, layers: int, intermediate: int, vocab: int) -> int:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama",
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 128,
        num_key_value_heads=hidden // 128,
        vocab_size=vocab,
        max_position_embeddings=1024,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--child", nargs=3, metavar=("PATH", "DECODER", "DTYPE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        path, decoder, dtype = args.child
        child(path, decoder == "true", None if dtype == "checkpoint" else dtype)
        return
    print(f"command: {' '.join(sys.argv)}")
    with tempfile.TemporaryDirectory() as work:
        params = save_target(Path(work), args.hidden, args.layers, args.intermediate, args.vocab)
        on_disk = sum(p.stat().st_size for p in Path(work).glob("*.safetensors")) / 2**20
        print(
            f"target: Llama, hidden {args.hidden}, {args.layers} layers, intermediate {args.intermediate}, vocabulary "
            f"{args.vocab}: {params:,} parameters, {on_disk:,.0f} MiB float32 on disk\n"
        )
        print(
            "| target_dtype | target_decoder | target parameters held | build s | peak RSS before build (MiB) | "
            "peak RSS after build (MiB) | build's peak increase (MiB) | peak RSS after reading the target's weights "
            "(MiB) |"
        )
        print("|---|---|---:|---:|---:|---:|---:|---:|")
        for dtype in ("checkpoint", "bfloat16"):
            for decoder in ("true", "false"):
                command = [sys.executable, __file__, "--child", work, decoder, dtype]
                output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
                r = json.loads(output.strip().splitlines()[-1])
                print(
                    f"| {dtype} | {decoder} | {r['target_params']:,} | {r['seconds']:.2f} | {r['before']['VmHWM']:,} | "
                    f"{r['after']['VmHWM']:,} | {r['after']['VmHWM'] - r['before']['VmHWM']:,} | "
                    f"{r['read']['VmHWM']:,} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
