"""Training from captured features vs online, per draft, in one process on the same documents; the bytes a
capture stores per training token against the full-capture formula.

For each quickstart config (its shipped target, its draft, the embedded corpus): the config's model and
data module are built as ``fit`` builds them, the first ``--documents`` documents are captured once
(``bfloat16``, timed), then the same micro-batches (``packing="buffer"``, the config's ``max_tokens`` and
``batch_size``) are trained online (the target runs every step) and from the features (no target
forward), as full optimizer steps (zero_grad, ``compute_loss`` with the same anchors in both, backward,
AdamW step) starting from the same weights. Repetitions alternate online / features so load drift on a
shared machine hits both alike; micro-batches are collated before timing (reading features from the
shards is timed apart, as the loader's share).

Reported per draft: real tokens per second in both modes and their ratio (medians of the repetitions),
the capture time, the loader's seconds per epoch from features, and bytes per training token: what the
capture holds on disk over the real tokens, next to the full-capture formula (every position, every
captured layer, plus full-vocabulary teacher logits, all in bfloat16:
``layers x hidden x 2 + vocabulary x 2``), and the same two figures for a Qwen3-4B-sized target
(hidden 2560, vocabulary 151,936) from the formula with this corpus' supervised fraction.

    .venv/bin/python benchmarks/features.py --documents 32 --repeats 3 --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from lightning_drafts.cli.fit import build_from_config
from lightning_drafts.datamodules.feature_store import FeatureStore
from lightning_drafts.datamodules.loader import PackedEpochDataset
from lightning_drafts.workflows.capture import capture_features

ROOT = Path(__file__).resolve().parents[1]
DRAFTS = ("eagle3", "mla_eagle3", "dflash", "dflash2", "dspark")
QWEN3_4B = {"hidden": 2560, "vocab": 151_936}


def loader(datamodule, features) -> PackedEpochDataset:
    return PackedEpochDataset(
        datamodule.train_documents,
        mode="buffer",
        max_tokens=datamodule.max_tokens,
        batch_size=datamodule.batch_size,
        pad_token_id=datamodule.pad_token_id,
        seed=0,
        shuffle=True,
        shuffle_buffer=datamodule.shuffle_buffer,
        world_size=1,
        rank=0,
        features=features,
    )


def epoch(module, batches, anchors, state) -> float:
    module.load_state_dict(state)
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-4)
    start = time.perf_counter()
    for batch, anchor in zip(batches, anchors, strict=True):
        optimizer.zero_grad(set_to_none=True)
        output = module.compute_loss(batch) if anchor is None else module.compute_loss(batch, anchors=anchor)
        output.loss.backward()
        optimizer.step()
    return time.perf_counter() - start


def bench(name: str, documents: int, repeats: int, work: Path) -> dict:
    config = ROOT / "configs" / "quickstart" / f"{name}.yaml"
    module, datamodule = build_from_config(
        [
            f"--config={config}",
            f"--data.init_args.max_documents={documents}",
            "--data.init_args.val_fraction=0",
        ]
    )
    datamodule.setup("fit")
    if hasattr(module, "build_vocab_mapping") and not bool(module.vocab_mapping_built):
        from lightning_drafts.eagle3 import count_supervised_tokens

        module.build_vocab_mapping(
            count_supervised_tokens(loader(datamodule, None), module.target.vocab_size)
        )
    directory = work / name
    summary = capture_features(module, datamodule, directory)
    store = FeatureStore(directory)
    source = store.source("data_files")
    start = time.perf_counter()
    offline = list(loader(datamodule, source))
    read_seconds = time.perf_counter() - start
    online = [{k: v for k, v in b.items() if not k.startswith("target_")} for b in offline]
    anchors = [
        module.sample_anchors(b, generator=torch.Generator().manual_seed(i))
        if hasattr(module, "sample_anchors")
        else None
        for i, b in enumerate(online)
    ]
    state = {k: v.clone() for k, v in module.state_dict().items()}
    epoch(module, offline[:1], anchors[:1], state)  # warmup
    epoch(module, online[:1], anchors[:1], state)
    times = {"online": [], "features": []}
    for _ in range(repeats):
        times["online"].append(epoch(module, online, anchors, state))
        times["features"].append(epoch(module, offline, anchors, state))
    real = sum(int(b["attention_mask"].sum()) for b in online)
    supervised = sum(int(b["loss_mask"].sum()) for b in online)
    stored = sum(path.stat().st_size for path in directory.glob("*.safetensors"))
    manifest = store.manifest
    layers, hidden, vocab = (
        len(manifest["layer_ids"]),
        manifest["target"]["hidden_size"],
        manifest["target"]["vocab_size"],
    )
    final_fraction = (
        manifest["sources"]["data_files"]["final_rows"] / manifest["sources"]["data_files"]["tokens"]
    )
    big = QWEN3_4B
    return {
        "draft": name,
        "real": real,
        "supervised_fraction": supervised / real,
        "online": real / statistics.median(times["online"]),
        "features": real / statistics.median(times["features"]),
        "capture_s": summary.seconds,
        "read_s": read_seconds,
        "bytes_per_token": stored / real,
        "full_formula": layers * hidden * 2 + vocab * 2,
        "big_ours": layers * big["hidden"] * 2 + final_fraction * big["hidden"] * 2,
        "big_full": layers * big["hidden"] * 2 + big["vocab"] * 2,
        "layers": layers,
        "final_positions": manifest["final_positions"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafts", nargs="+", default=list(DRAFTS), choices=DRAFTS)
    parser.add_argument("--documents", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"command: {' '.join(sys.argv)}; torch {torch.__version__}, {args.threads} threads, CPU")
    print(
        "| draft | layers stored | final state at | real tokens | online tokens/s | features tokens/s | "
        "features/online | capture s | feature read s/epoch | bytes/token stored | full-capture formula "
        "bytes/token | Qwen3-4B-sized: ours / full (KB/token) |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    with tempfile.TemporaryDirectory() as work:
        for name in args.drafts:
            r = bench(name, args.documents, args.repeats, Path(work))
            print(
                f"| {r['draft']} | {r['layers']} | {r['final_positions']} | {r['real']:,} | {r['online']:,.0f} | "
                f"{r['features']:,.0f} | {r['features'] / r['online']:.2f}x | {r['capture_s']:.1f} | "
                f"{r['read_s']:.2f} | {r['bytes_per_token']:,.0f} | {r['full_formula']:,} | "
                f"{r['big_ours'] / 1e3:,.1f} / {r['big_full'] / 1e3:,.1f} ({r['big_full'] / r['big_ours']:.0f}x smaller) |",
                flush=True,
            )


if __name__ == "__main__":
    main()
