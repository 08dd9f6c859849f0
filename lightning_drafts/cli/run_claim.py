"""A new fit's TensorBoard run directory, claimed atomically.

``TensorBoardLogger`` picks its ``version_N`` by listing the existing ones and creates the directory
later, so two fits of one config started together both pick ``version_0`` and write their event files,
``config.yaml`` and checkpoints into the same run. Here the directory is claimed up front with
``os.mkdir``, which exactly one process can win for a given name (the loser takes the next number), and
the logger is given the number it won. Only the launching process (global rank 0) claims: the processes a
multi-device fit starts follow its run as Lightning already arranges.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lightning_drafts.cli.resume import VERSION_DIR, tensorboard_run_root


def claim_next_version(root: Path) -> int:
    """Create ``root/version_N`` for the first ``N`` past every existing version that no other process has
    created, and return ``N``."""
    root.mkdir(parents=True, exist_ok=True)
    taken = [int(match.group(1)) for p in root.iterdir() if (match := VERSION_DIR.match(p.name))]
    version = max(taken, default=-1) + 1
    while True:
        try:
            (root / f"version_{version}").mkdir()
        except FileExistsError:
            version += 1
        else:
            return version


def claim_run_directory(section: Any) -> int | None:
    """Give the config ``section``'s TensorBoardLogger (one whose version is left to Lightning, on a local
    ``save_dir``) a version directory of its own; returns the version claimed, if any."""
    found = tensorboard_run_root(section.get("trainer", {}).get("logger"))
    if found is None or not _launching_process():
        return None
    init_args, root = found
    if "://" in str(init_args.get("save_dir") or ""):
        return None  # an object store has no atomic mkdir; Lightning's own choice stands
    init_args["version"] = claim_next_version(root)
    return init_args["version"]


def _launching_process() -> bool:
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    return getattr(rank_zero_only, "rank", 0) == 0 and int(os.environ.get("NODE_RANK", "0") or 0) == 0
