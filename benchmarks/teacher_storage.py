"""EAGLE-3's teacher in a features directory: the target's final state at supervised tokens (what a capture
stores: the frozen LM head recomputes the teacher at train time, for any draft vocabulary) against the
teacher itself, the draft-vocabulary logits and the full-vocabulary greedy token, read from disk.

The EAGLE-3 teacher at a supervised position is the target's logits over the draft vocabulary plus whether
the target's greedy token (argmax over the *full* vocabulary) is in it; so the logits form stores
``draft_vocab x bytes + 4`` (the int32 greedy id) per supervised token where the state form stores
``hidden x bytes``, and both keep an int32 position. The logits form is tied to one draft vocabulary
(another ``draft_vocab_size`` or token counts means capturing again); the state form is not.

1. Quickstart, measured (``--documents`` of the EAGLE-3 quickstart: the shipped ``tiny-llama``, draft
   vocabulary 1,024): one ``capture_features`` (the state form, timed); the logits form is written from
   those shards by the frozen LM head (the same matmul a capture would run, timed as the extra pass: the
   state capture's target forward is shared); bytes of each form from the shards; then the same micro-
   batches trained as full optimizer steps from (a) the state (``compute_loss``: the LM head runs in the
   step) and (b) the stored logits (``teacher_from_logits`` + ``loss_from_teacher``), repetitions
   alternating, and the loader's read of each form timed apart (all times in process CPU seconds). The
   first micro-batch's loss of (a) and (b) is printed as a check (equal up to the storage dtype's
   rounding; ``--dtype float32``: to float error).
2. Realistic sizes: bytes per supervised token and per training token by formula (bfloat16, three
   captured layers, this corpus' supervised fraction), and, measured on CPU at ``--hidden`` /
   ``--vocab`` / ``--draft-vocab`` (default 4,096 / 128,256 / 32,000, bfloat16), the teacher's share of a
   step per supervised token: (a) read the state rows from a page-cached safetensors file and run the
   LM head over the draft vocabulary and the full-vocabulary argmax (``FrozenTarget.logits`` /
   ``greedy_tokens``), vs (b) read the logits rows and greedy ids. The rest of the step is the same in
   both forms.

    .venv/bin/python benchmarks/teacher_storage.py --documents 64 --repeats 3 --threads 1
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

# Run as a script, so its own folder is on the path: the features benchmark's train loader, reused as is.
from features import loader
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from lightning_drafts.cli.fit import build_from_config
from lightning_drafts.datamodules.feature_store import FeatureStore, SourceFeatures
from lightning_drafts.datamodules.packing import place
from lightning_drafts.eagle3 import count_supervised_tokens
from lightning_drafts.training.target import FrozenTarget
from lightning_drafts.workflows.capture import capture_features

ROOT = Path(__file__).resolve().parents[1]
# The process' CPU time, not the wall clock: on a shared machine the wall time is partly other processes'
# (one thread: CPU time is the compute; page-cache reads are counted as the copying they cost).
clock = time.process_time
LAYERS = 3  # EAGLE-3's captured layers
# (name, hidden, vocabulary, draft vocabulary) of the formula table; the quickstart row is measured too.
SIZES = [
    ("Qwen3-4B-sized", 2560, 151_936, 32_000),
    ("Llama-3.1-8B-sized", 4096, 128_256, 32_000),
    ("Llama-3.1-8B-sized, draft vocab 16k", 4096, 128_256, 16_000),
    ("Llama-3.3-70B-sized", 8192, 128_256, 32_000),
    ("break-even: draft vocab = hidden", 4096, 128_256, 4096),
]


@torch.no_grad()
def write_teacher_logits(module, store: FeatureStore, directory: Path, dtype: torch.dtype) -> float:
    """Per state shard, a row-aligned shard of the teacher (draft-vocabulary logits, greedy id); seconds."""
    start = clock()
    target, ids = module.target, module.draft.selected_token_ids
    for shard in store.manifest["sources"]["data_files"]["shards"]:
        with safe_open(str(store.directory / shard["file"]), framework="pt") as handle:
            state = handle.get_tensor("last_hidden_state").to(target.compute_dtype)
        logits = target.logits(state, ids).to(dtype)
        greedy = target.greedy_tokens(state).to(torch.int32)
        save_file({"teacher_logits": logits, "teacher_greedy": greedy}, str(directory / shard["file"]))
    return clock() - start


class TeacherRows:
    """The stored teacher of a micro-batch's supervised positions, in the batch's row-major order (the rows
    are aligned with the state shards' final-state rows, so the state store's tables locate them)."""

    def __init__(self, source: SourceFeatures, directory: Path) -> None:
        self.source = source
        self.handles = [safe_open(str(directory / path.name), framework="pt") for path in source.paths]
        self.states = [safe_open(str(path), framework="pt") for path in source.paths]

    def gather(self, documents, placement) -> tuple[Tensor, Tensor]:
        source = self.source
        found = np.searchsorted(source.doc_starts, documents.starts[placement.docs])
        logits, greedy, slots = [], [], []
        for j, doc in enumerate(found.tolist()):
            rows = int(source.doc_final_rows[doc])
            if not rows:
                continue
            shard = int(source.doc_shard[doc])
            begin = int(source.doc_final_offset[doc])
            logits.append(self.handles[shard].get_slice("teacher_logits")[begin : begin + rows])
            greedy.append(self.handles[shard].get_slice("teacher_greedy")[begin : begin + rows])
            positions = self.states[shard].get_slice("last_hidden_positions")[begin : begin + rows].long()
            slots.append(positions + int(placement.doc_base[j]))
        order = torch.cat(slots).argsort()
        return torch.cat(logits)[order], torch.cat(greedy)[order].long()


def step_state(module, batch):
    return module.compute_loss(batch)


def step_logits(module, item):
    batch, logits, greedy = item
    packed = module.prepare_batch(batch)
    with torch.no_grad():
        aux = torch.cat(module.target_output(packed, module.target_layer_ids).hidden_states, dim=-1)
        teacher = module.teacher_from_logits(packed, aux, logits.to(module.target.compute_dtype), greedy)
    return module.loss_from_teacher(packed, teacher)


def epoch(module, items, step, state) -> float:
    module.load_state_dict(state)
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-4)
    start = clock()
    for item in items:
        optimizer.zero_grad(set_to_none=True)
        step(module, item).loss.backward()
        optimizer.step()
    return clock() - start


def quickstart(documents: int, repeats: int, dtype: str, work: Path) -> dict:
    config = ROOT / "configs" / "quickstart" / "eagle3.yaml"
    module, datamodule = build_from_config(
        [
            f"--config={config}",
            f"--data.init_args.max_documents={documents}",
            "--data.init_args.val_fraction=0",
        ]
    )
    datamodule.setup("fit")
    module.build_vocab_mapping(count_supervised_tokens(loader(datamodule, None), module.target.vocab_size))
    state_dir, logits_dir = work / "state", work / "logits"
    logits_dir.mkdir(parents=True)
    start = clock()
    capture_features(module, datamodule, state_dir, dtype=dtype)
    capture_s = clock() - start
    store = FeatureStore(state_dir)
    storage = getattr(torch, dtype)
    logits_s = write_teacher_logits(module, store, logits_dir, storage)

    nbytes = {"aux": 0, "state": 0, "positions": 0, "logits": 0, "greedy": 0}
    for path in state_dir.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as handle:
            for key, name in (
                ("hidden_states", "aux"),
                ("last_hidden_state", "state"),
                ("last_hidden_positions", "positions"),
            ):
                nbytes[name] += handle.get_tensor(key).nbytes
        with safe_open(str(logits_dir / path.name), framework="pt") as handle:
            nbytes["logits"] += handle.get_tensor("teacher_logits").nbytes
            nbytes["greedy"] += handle.get_tensor("teacher_greedy").nbytes
    entry = store.manifest["sources"]["data_files"]
    supervised, tokens = entry["final_rows"], entry["tokens"]

    source = store.source("data_files")
    start = clock()
    with_state = list(loader(datamodule, source))
    read_state = clock() - start
    aux_only = copy.copy(source)
    aux_only.stores_final = False
    rows = TeacherRows(source, logits_dir)
    dataset = loader(datamodule, aux_only)
    start = clock()
    with_logits = []
    for index in range(len(dataset)):
        placement = place(dataset.documents, dataset.plan(0), index)
        with_logits.append((dataset[index], *rows.gather(dataset.documents, placement)))
    read_logits = clock() - start

    initial = {k: v.clone() for k, v in module.state_dict().items()}
    module.load_state_dict(initial)
    loss_a = step_state(module, with_state[0]).loss.item()
    loss_b = step_logits(module, with_logits[0]).loss.item()
    epoch(module, with_state[:1], step_state, initial)  # warmup
    epoch(module, with_logits[:1], step_logits, initial)
    times = {"state": [], "logits": []}
    for _ in range(repeats):
        times["state"].append(epoch(module, with_state, step_state, initial))
        times["logits"].append(epoch(module, with_logits, step_logits, initial))
    real = sum(int(b["attention_mask"].sum()) for b in with_state)
    hidden = store.manifest["target"]["hidden_size"]
    return {
        "hidden": hidden,
        "vocab": store.manifest["target"]["vocab_size"],
        "draft_vocab": int(module.draft.selected_token_ids.numel()),
        "supervised": supervised,
        "tokens": tokens,
        "nbytes": nbytes,
        "capture_s": capture_s,
        "logits_s": logits_s,
        "read_state": read_state,
        "read_logits": read_logits,
        "step_state": statistics.median(times["state"]),
        "step_logits": statistics.median(times["logits"]),
        "real": real,
        "loss_a": loss_a,
        "loss_b": loss_b,
    }


def formula(hidden: int, draft_vocab: int, fraction: float, itemsize: int = 2) -> dict[str, float]:
    """Bytes per supervised token of each teacher form, and per training token with the captured layers."""
    state = hidden * itemsize + 4
    logits = draft_vocab * itemsize + 4 + 4
    aux = LAYERS * hidden * itemsize
    return {"state": state, "logits": logits, "aux": aux, "train_state": aux + fraction * state}


@torch.no_grad()
def teacher_cost(hidden: int, vocab: int, draft_vocab: int, rows: int, repeats: int, work: Path) -> dict:
    """Seconds per supervised token of each form's teacher part at these sizes (bfloat16, CPU)."""
    dtype = torch.bfloat16
    # One tiny decoder layer: only the LM head (tied to the embedding to halve the memory) is used.
    spec = {
        "model_type": "llama",
        "hidden_size": hidden,
        "vocab_size": vocab,
        "num_hidden_layers": 1,
        "intermediate_size": 64,
        "num_attention_heads": hidden // 128,
        "num_key_value_heads": 1,
        "tie_word_embeddings": True,
    }
    target = FrozenTarget(spec, dtype=dtype)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randperm(vocab, generator=generator)[:draft_vocab].sort().values
    path = work / "teacher.safetensors"
    save_file(
        {
            "state": torch.randn(rows, hidden, generator=generator).to(dtype),
            "logits": torch.randn(rows, draft_vocab, generator=generator).to(dtype),
            "greedy": torch.randint(vocab, (rows,), generator=generator, dtype=torch.int32),
        },
        str(path),
    )
    handle = safe_open(str(path), framework="pt")
    for key in ("state", "logits", "greedy"):
        handle.get_tensor(key)  # into the page cache, as a hot features directory

    def from_state() -> None:
        state = handle.get_slice("state")[0:rows]
        target.logits(state, ids)
        target.greedy_tokens(state)

    def from_logits() -> None:
        # Copied out, as a step's host-to-device transfer reads every byte (a slice may stay a map).
        handle.get_slice("logits")[0:rows].clone()
        handle.get_slice("greedy")[0:rows].clone()

    out = {}
    for name, run in (("state", from_state), ("logits", from_logits)):
        run()
        seconds = []
        for _ in range(repeats):
            start = clock()
            run()
            seconds.append(clock() - start)
        out[name] = statistics.median(seconds) / rows
    # The state form's two matmuls apart: the draft-vocabulary head and the full-vocabulary argmax.
    state = handle.get_slice("state")[0:rows]
    start = clock()
    target.greedy_tokens(state)
    out["greedy"] = (clock() - start) / rows
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=128_256)
    parser.add_argument("--draft-vocab", type=int, default=32_000)
    parser.add_argument(
        "--rows", type=int, default=64, help="supervised rows of the realistic-size measurement"
    )
    parser.add_argument("--skip-realistic", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"command: {' '.join(sys.argv)}; torch {torch.__version__}, {args.threads} threads, CPU")
    with tempfile.TemporaryDirectory() as work:
        r = quickstart(args.documents, args.repeats, args.dtype, Path(work) / "quickstart")
        b, n = r["nbytes"], r["supervised"]
        print(
            f"\n## Quickstart (EAGLE-3, tiny-llama: hidden {r['hidden']}, vocabulary {r['vocab']}, draft vocabulary "
            f"{r['draft_vocab']}; {args.documents} documents, {r['tokens']:,} tokens, {n:,} supervised; {args.dtype})\n"
        )
        print(
            "| teacher stored as | bytes / supervised token | bytes / training token (teacher) | "
            "bytes / training token (with the captured layers) | capture CPU s | read CPU s / epoch | "
            "step CPU s / epoch | real tokens per CPU s (steps) |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        forms = (
            ("final state (LM head in the step)", b["state"] + b["positions"], r["capture_s"], "state"),
            (
                "draft-vocab logits + greedy id",
                b["logits"] + b["greedy"] + b["positions"],
                r["capture_s"] + r["logits_s"],
                "logits",
            ),
        )
        for label, teacher_bytes, capture_s, key in forms:
            capture = f"{capture_s:.2f}" if key == "state" else f"{r['capture_s']:.2f} + {r['logits_s']:.2f}"
            print(
                f"| {label} | {teacher_bytes / n:,.1f} | {teacher_bytes / r['tokens']:,.1f} | "
                f"{(teacher_bytes + b['aux']) / r['tokens']:,.1f} | {capture} | {r['read_' + key]:.3f} | "
                f"{r['step_' + key]:.2f} | {r['real'] / r['step_' + key]:,.0f} |",
                flush=True,
            )
        print(
            f"\nfirst micro-batch loss: from the state {r['loss_a']:.8f}, from the logits {r['loss_b']:.8f} "
            f"(relative difference {abs(r['loss_a'] - r['loss_b']) / abs(r['loss_a']):.1e})"
        )
        fraction = n / r["tokens"]
        print(
            f"\n## Realistic sizes by formula (bfloat16, {LAYERS} captured layers, supervised fraction {fraction:.3f})\n"
        )
        print(
            "| target | hidden | draft vocab | state B / supervised token | logits B / supervised token | "
            "logits / state | training token with layers + state (B) | + logits instead (B) |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        rows = [("quickstart (tiny-llama)", r["hidden"], None, r["draft_vocab"])] + SIZES
        for name, hidden, _, draft_vocab in rows:
            f = formula(hidden, draft_vocab, fraction)
            print(
                f"| {name} | {hidden:,} | {draft_vocab:,} | {f['state']:,} | {f['logits']:,} | "
                f"{f['logits'] / f['state']:.2f}x | {f['train_state']:,.0f} | "
                f"{f['aux'] + fraction * f['logits']:,.0f} |"
            )
        if args.skip_realistic:
            return
        cost = teacher_cost(args.hidden, args.vocab, args.draft_vocab, args.rows, args.repeats, Path(work))
        print(
            f"\n## Teacher part of a step at hidden {args.hidden:,}, vocabulary {args.vocab:,}, draft vocabulary "
            f"{args.draft_vocab:,} (bfloat16, CPU, {args.rows} supervised rows, page-cached file)\n"
        )
        print("| teacher stored as | CPU ms / supervised token | of which the full-vocabulary argmax |")
        print("|---|---:|---:|")
        print(f"| final state | {cost['state'] * 1e3:.3f} | {cost['greedy'] * 1e3:.3f} |")
        print(f"| draft-vocab logits + greedy id | {cost['logits'] * 1e3:.4f} | - |")


if __name__ == "__main__":
    main()
