"""Resuming a fit into the TensorBoard run it continues.

A fresh ``TensorBoardLogger`` takes the next ``version_N``, so a resumed fit would log (and look for
``last.ckpt``) in a new directory and split the curves. Resuming from a checkpoint of that logger's run
(``--ckpt_path last``, or a path under ``<save_dir>/<name>/version_N/``) reuses that run's version instead;
a config that names its own ``version`` keeps it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

LAST_CHECKPOINT = re.compile(r"^last(-\d+)?\.ckpt$")
VERSION_DIR = re.compile(r"^version_(\d+)$")


def tensorboard_run_root(logger: Any) -> tuple[Any, Path] | None:
    """The init_args of a config's single TensorBoardLogger whose version is left to Lightning, and the
    directory its versions live in (``save_dir/name``); ``None`` for any other logger set-up."""
    if logger is None or isinstance(logger, (bool, list)):
        return None
    class_path = str(getattr(logger, "class_path", None) or "")
    if not class_path.endswith("TensorBoardLogger"):
        return None
    init_args = logger.init_args
    if init_args.get("version") is not None:
        return None
    name = init_args.get("name")
    name = "lightning_logs" if name is None else name
    return init_args, Path(init_args.get("save_dir") or ".") / name


def run_version_of(ckpt_path: str, root: Path) -> str | None:
    """The ``version_N`` directory under ``root`` that ``ckpt_path`` resumes: for ``last``, the newest
    run that holds a ``last.ckpt``; for a path, the run whose ``checkpoints`` folder it lies in."""
    if ckpt_path == "last":
        runs = []
        for run in root.glob("version_*") if root.is_dir() else ():
            match = VERSION_DIR.match(run.name)
            checkpoints = run / "checkpoints"
            if (
                match
                and checkpoints.is_dir()
                and any(LAST_CHECKPOINT.match(f.name) for f in checkpoints.iterdir())
            ):
                runs.append((int(match.group(1)), run.name))
        return max(runs)[1] if runs else None
    path = Path(ckpt_path).resolve()
    run = path.parent.parent
    if path.parent.name == "checkpoints" and VERSION_DIR.match(run.name) and run.parent == root.resolve():
        return run.name
    return None


def resume_into_same_run(section: Any) -> str | None:
    """Set the config ``section``'s TensorBoardLogger version to the run its ``ckpt_path`` continues;
    returns the version set, if any."""
    ckpt_path = section.get("ckpt_path")
    if not ckpt_path:
        return None
    found = tensorboard_run_root(section.get("trainer", {}).get("logger"))
    if found is None:
        return None
    init_args, root = found
    version = run_version_of(str(ckpt_path), root)
    if version is not None:
        init_args["version"] = version
    return version


def resumed_checkpoint(section: Any) -> Path | None:
    """The file the config ``section``'s ``ckpt_path`` resumes: the path itself, or for ``last`` the newest
    ``last*.ckpt`` of the TensorBoard run it continues (where Lightning looks); ``None`` when there is none
    to read (Lightning then names a missing checkpoint itself)."""
    ckpt_path = section.get("ckpt_path")
    if not ckpt_path:
        return None
    if ckpt_path != "last":
        return Path(ckpt_path) if Path(ckpt_path).is_file() else None
    found = tensorboard_run_root(section.get("trainer", {}).get("logger"))
    version = None if found is None else run_version_of("last", found[1])
    if version is None:
        return None
    checkpoints = found[1] / version / "checkpoints"
    candidates = [p for p in checkpoints.iterdir() if LAST_CHECKPOINT.match(p.name)]
    return max(candidates, key=lambda p: p.stat().st_mtime)
