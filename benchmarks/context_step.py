"""One packed training step of a draft on one row of WIDTH tokens, in this fresh process: its peak memory.

Usage: context_step.py DRAFT WIDTH TARGETS [--device cpu|cuda] [--threads N] [--seed S]

``DRAFT`` is a quickstart config (``configs/quickstart/<draft>.yaml``: the draft's own settings);
``TARGETS`` is ``shipped`` (the config's shipped tiny trained target, documents of 64-768 tokens) or
``tiny`` (the random tiny targets of ``benchmarks/tiny_targets.py``, a 96-id vocabulary, documents of 64-256
tokens; the draft vocabulary is the target's). The row packs documents of
random lengths (seeded; the last one takes what is left), the first quarter of each unsupervised. The
step is the target forward, the draft, the loss, its backward and one AdamW step. Prints one JSON line:
the step's peak memory above what the process held before it (CPU: the resident-set high-water mark,
reset through ``/proc/self/clear_refs`` after ``malloc_trim``; CUDA: ``torch.cuda.max_memory_allocated``),
its wall and CPU seconds, the loss, the supervised count and whether every trainable parameter got a
finite gradient that the step applied.

Used by ``tests/families/test_context_memory.py`` and ``benchmarks/context_memory.py``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tiny_targets import TINY_TARGETS  # noqa: E402

# The random tiny target of each draft's shipped one.
TINY_OF_SHIPPED = {
    "shipped:tiny-llama": "llama",
    "shipped:tiny-qwen3": "qwen3",
    "shipped:tiny-deepseek-v3": "deepseek_v3",
}
# Document lengths (inclusive range) per target set: the tiny targets hold 256 positions.
DOCUMENT_LENGTHS = {"shipped": (64, 768), "tiny": (64, 256)}


def build_module(draft: str, targets: str):
    """The quickstart config's module of ``draft`` on the ``targets`` set, and the target's vocabulary."""
    model = yaml.safe_load((ROOT / "configs" / "quickstart" / f"{draft}.yaml").read_text())["model"]
    module_name, class_name = model["class_path"].rsplit(".", 1)
    cls = getattr(importlib.import_module(module_name), class_name)
    init_args = dict(model["init_args"])
    init_args.pop("learning_rate", None)
    if targets == "tiny":
        init_args["target"] = TINY_TARGETS[TINY_OF_SHIPPED[init_args["target"]]]
        init_args.pop("draft_vocab_size", None)
    elif targets != "shipped":
        raise ValueError(f"TARGETS is 'shipped' or 'tiny', got {targets!r}")
    torch.manual_seed(0)
    module = cls(**init_args)
    return module, module.target.vocab_size


def document_lengths(width: int, low: int, high: int, seed: int) -> list[int]:
    """Lengths drawn uniformly from ``[low, high]`` filling ``width`` exactly (the last one is what is
    left; a tail shorter than ``low`` joins the document before it)."""
    rng = np.random.default_rng(seed)
    lengths, total = [], 0
    while total < width:
        lengths.append(min(int(rng.integers(low, high + 1)), width - total))
        total += lengths[-1]
    if len(lengths) > 1 and lengths[-1] < low:
        tail = lengths.pop()
        lengths[-1] += tail
    return lengths


def packed_row(width: int, vocab: int, lengths: list[int], seed: int) -> dict[str, torch.Tensor]:
    """One packed contract row: token ids 4.. (no special id), each document's first quarter unsupervised."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (width,), generator=generator)
    return {
        "input_ids": ids[None],
        "attention_mask": torch.ones(1, width, dtype=torch.long),
        "loss_mask": torch.cat([torch.arange(n) >= n // 4 for n in lengths]).long()[None],
        "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
        "seq_lens": torch.tensor([lengths]),
    }


def prepared(draft: str, width: int, targets: str, seed: int, device: str):
    """The module (train mode, on ``device``), its row and its anchors (None for EAGLE-3)."""
    module, vocab = build_module(draft, targets)
    batch = packed_row(width, vocab, document_lengths(width, *DOCUMENT_LENGTHS[targets], seed), seed)
    if getattr(module, "compresses_vocab", False):
        module.build_vocab_mapping(torch.bincount(batch["input_ids"].reshape(-1), minlength=vocab))
    module.train()
    module.to(device)
    batch = {key: value.to(device) for key, value in batch.items()}
    anchors = None
    if hasattr(module, "sample_anchors"):
        anchors = module.sample_anchors(batch, torch.Generator(device=device).manual_seed(seed))
    return module, batch, anchors


def train_step(module, optimizer, batch: dict[str, torch.Tensor], anchors) -> dict:
    output = module.compute_loss(batch, anchors=anchors)
    output.loss.backward()
    optimizer.step()
    return {"loss": float(output.loss), "valid_tokens": int(output.valid_tokens)}


def _status(field: str) -> int:
    with open("/proc/self/status") as lines:
        for line in lines:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def measure(draft: str, width: int, targets: str, seed: int, device: str, threads: int) -> dict:
    torch.set_num_threads(threads)
    module, batch, anchors = prepared(draft, width, targets, seed, device)
    trainable = [p for p in module.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in trainable]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start_bytes = torch.cuda.memory_allocated()
    else:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        start_bytes = _status("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")
    start, cpu_start = time.perf_counter(), time.process_time()
    result = train_step(module, optimizer, batch, anchors)
    if device == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - start_bytes
    else:
        peak = _status("VmHWM") - start_bytes
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    grads = [p.grad for p in trainable]
    return {
        **result,
        "draft": draft,
        "width": width,
        "documents": int(batch["seq_lens"].count_nonzero()),
        "peak_bytes": peak,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "finite_gradients": all(g is not None and bool(torch.isfinite(g).all()) for g in grads),
        "parameters_moved": sum(
            not torch.equal(b, p.detach()) for b, p in zip(before, trainable, strict=True)
        ),
        "parameters": len(trainable),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("draft")
    parser.add_argument("width", type=int)
    parser.add_argument("targets", choices=tuple(DOCUMENT_LENGTHS))
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(json.dumps(measure(args.draft, args.width, args.targets, args.seed, args.device, args.threads)))


if __name__ == "__main__":
    main()
