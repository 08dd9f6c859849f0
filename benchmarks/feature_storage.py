"""Read speed of the two storage candidates for captured features: safetensors shards (what
``lightning_drafts.datamodules.feature_store`` writes) vs Arrow through ``datasets``.

The same random documents' features (``--documents`` documents of 64..1024 tokens, ``--width`` features a
token) are written both ways; then random micro-batches of ``--batch`` documents are read as a trainer
would, each document's ``[tokens, width]`` features into one tensor: safetensors through
``safe_open(...).get_slice`` (one contiguous slice per document), Arrow through ``datasets`` with the
numpy format (one row per document, an ``Array2D`` column). Arrow has no bfloat16, so both store the
features as float32 here to compare like with like (the shards also store bfloat16, half the bytes). The
files are read once before timing, so both come from the page cache: the figures compare the readers.

    .venv/bin/python benchmarks/feature_storage.py --documents 256 --width 1536
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import datasets
import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=256)
    parser.add_argument("--width", type=int, default=1536)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--reads", type=int, default=20)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    lengths = rng.integers(64, 1025, size=args.documents)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    features = torch.randn(int(offsets[-1]), args.width)
    batches = [rng.choice(args.documents, size=args.batch, replace=False) for _ in range(args.reads)]

    with tempfile.TemporaryDirectory() as work:
        shard = Path(work) / "features.safetensors"
        save_file({"hidden_states": features}, str(shard))
        rows = datasets.Dataset.from_dict(
            {"hidden_states": [features[offsets[i] : offsets[i + 1]].numpy() for i in range(args.documents)]},
            features=datasets.Features(
                {"hidden_states": datasets.Array2D(shape=(None, args.width), dtype="float32")}
            ),
        )
        rows.save_to_disk(str(Path(work) / "arrow"))
        arrow = datasets.load_from_disk(str(Path(work) / "arrow")).with_format("numpy")

        handle = safe_open(str(shard), framework="pt")

        def read_shard(docs: np.ndarray) -> torch.Tensor:
            view = handle.get_slice("hidden_states")
            return torch.cat([view[int(offsets[d]) : int(offsets[d + 1])] for d in docs])

        def read_arrow(docs: np.ndarray) -> torch.Tensor:
            return torch.cat([torch.from_numpy(a) for a in arrow[docs.tolist()]["hidden_states"]])

        for reader in (read_shard, read_arrow):  # warm the page cache and check equality
            assert torch.equal(reader(batches[0]), read_shard(batches[0]))
        timings = {}
        for name, reader in (("safetensors get_slice", read_shard), ("arrow (datasets, numpy)", read_arrow)):
            seconds = []
            for docs in batches:
                start = time.perf_counter()
                reader(docs)
                seconds.append(time.perf_counter() - start)
            timings[name] = statistics.median(seconds)
    tokens = int(np.mean([lengths[b].sum() for b in batches]))
    megabytes = tokens * args.width * 4 / 2**20
    print(
        f"{args.documents} documents, {args.width} float32 features a token; micro-batches of {args.batch} documents"
    )
    print(f"(~{tokens:,} tokens, {megabytes:.1f} MiB), median of {args.reads} reads")
    print("| reader | ms per micro-batch | GiB/s |")
    print("|---|---:|---:|")
    for name, seconds in timings.items():
        print(f"| {name} | {seconds * 1e3:.1f} | {megabytes / 1024 / seconds:.2f} |")


if __name__ == "__main__":
    main()
