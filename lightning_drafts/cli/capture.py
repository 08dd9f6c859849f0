"""``lightning-drafts capture``: run a fit config's frozen target once over its data and store the
features its draft trains from (then ``fit --data.init_args.features_dir DIR`` trains without the target)."""

from __future__ import annotations

import argparse
import os

from lightning_drafts.cli.arguments import CommandParser, positive_int
from lightning_drafts.cli.process_group import end_process_group


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="lightning-drafts capture",
        description="Capture a fit config's target features for its draft into a features directory.",
        epilog="Other options (e.g. --data.init_args.max_documents=100) override the config as in `fit`.",
    )
    parser.add_argument("--config", required=True, action="append", help="the fit YAML config(s)")
    parser.add_argument(
        "--output", required=True, help="the features directory (resumed if it holds a capture)"
    )
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        help="storage dtype: bfloat16 (default), float16, float32, float8_e4m3fn",
    )
    parser.add_argument(
        "--rows-per-batch", type=positive_int, default=None, help="documents per target forward"
    )
    parser.add_argument(
        "--shard-bytes", type=positive_int, default=None, help="about how many bytes per shard (1 GiB)"
    )
    parser.add_argument(
        "--keep-free-bytes", type=int, default=0, help="refuse unless this much disk stays free"
    )
    parser.add_argument(
        "--max-shards", type=positive_int, default=None, help="stop after this many shards (resumable)"
    )
    return parser


def capture_main(args: list[str]) -> None:
    parsed, overrides = build_parser().parse_known_args(args)

    import torch
    import torch.distributed as dist

    from lightning_drafts.cli.fit import build_from_config
    from lightning_drafts.workflows.capture import SHARD_BYTES, capture_features

    device = None
    # Under torchrun every rank captures its own shards (the manifest is completed by rank 0).
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        cuda = torch.cuda.is_available()
        dist.init_process_group("nccl" if cuda else "gloo")
        if cuda:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
    module, datamodule = build_from_config([f"--config={c}" for c in parsed.config] + overrides)
    summary = capture_features(
        module,
        datamodule,
        parsed.output,
        dtype=parsed.dtype,
        rows_per_batch=parsed.rows_per_batch,
        shard_bytes=parsed.shard_bytes or SHARD_BYTES,
        keep_free_bytes=parsed.keep_free_bytes,
        max_shards=parsed.max_shards,
        device=device,
    )
    state = "complete" if summary.complete else "incomplete (run the same command again to resume)"
    end_process_group()
    print(
        f"captured {summary.shards_written} shard(s) in {summary.seconds:.1f} s -> {summary.directory}: "
        f"{state}, about {summary.bytes_estimated / 2**20:.1f} MiB of features"
    )
