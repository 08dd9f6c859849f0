"""Where a data module's rows come from: its ``data_files`` value read by the reader it names.

Local JSON / JSONL files (globs and ``.gz`` too) go through the row-by-row reader of
:mod:`lightning_drafts.datamodules.chat_files`; Parquet files and a hub dataset id through ``datasets``.
A directory, a missing file, an unknown extension or a mix of formats is refused with what to pass instead.
"""

from __future__ import annotations

import glob
import os
from collections import Counter
from pathlib import Path

import datasets

from lightning_drafts.datamodules.chat_files import ChatRows, read_chat_files
from lightning_drafts.datamodules.row_locations import RowLocations

# File extension (after any .gz) -> the datasets builder that reads it.
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def load_data_files(
    files: str | os.PathLike | list, cache_dir: Path, strict: bool = False, drop_media: bool = False
) -> tuple[datasets.Dataset, str, ChatRows | None, RowLocations]:
    """The rows of ``files``, a fingerprint of the source, what the row-by-row reader rejected (``None``
    for Parquet and hub datasets, which ``datasets`` reads whole), and where each row came from."""
    paths = [files] if isinstance(files, (str, os.PathLike)) else list(files)
    if not paths:
        raise ValueError(
            "data_files is an empty list; pass file paths, a hub id, or None for the embedded corpus"
        )
    paths = [str(path) for path in paths]
    if len(paths) == 1 and _looks_like_hub_id(paths[0]):
        rows = datasets.load_dataset(paths[0], split="train", cache_dir=str(cache_dir / "sources"))
        return rows, rows._fingerprint, None, RowLocations(name=f"{paths[0]} (train split)")
    builders = set()
    for path in paths:
        if Path(path).is_dir():
            raise ValueError(_directory_given(Path(path)))
        name = path.removesuffix(".gz")
        builder = next((b for ext, b in FILE_BUILDERS.items() if name.endswith(ext)), None)
        if builder is None:
            raise ValueError(f"data file {path!r} is not .json, .jsonl or .parquet; convert it or rename it")
        if not glob.has_magic(path) and not Path(path).exists():
            raise ValueError(f"data file {path!r} does not exist")
        if glob.has_magic(path) and not glob.glob(path):
            raise ValueError(f"data file pattern {path!r} matches no file")
        builders.add(builder)
    if len(builders) > 1:
        raise ValueError(f"data_files {paths} mix JSON and Parquet; pass files of one format")
    builder = builders.pop()
    if builder != "json":
        rows = datasets.load_dataset(
            builder, data_files=paths, split="train", cache_dir=str(cache_dir / "sources")
        )
        # The datasets fingerprint of a loaded source hashes its files (paths, sizes, times).
        return rows, rows._fingerprint, None, RowLocations.of_files(paths)
    # JSON is read row by row, not by datasets' JSON builder: that one refuses a whole file for one bad
    # line or byte without saying where, keeps the last of two equal keys silently, and fails on a file
    # that mixes string contents with lists of content parts (chat_files).
    expanded = sorted(
        {Path(m) for path in paths for m in (glob.glob(path) if glob.has_magic(path) else [path])}
    )
    rows, fingerprint, read = read_chat_files(expanded, strict, drop_media)
    return rows, fingerprint, read, RowLocations(name=", ".join(paths), listed=tuple(read.where))


def _directory_given(directory: Path) -> str:
    """Why a directory is not a data file, with the glob that reads the files it holds."""
    counts: Counter = Counter()
    for child in directory.iterdir():
        name = child.name.removesuffix(".gz")
        ext = next((ext for ext in FILE_BUILDERS if name.endswith(ext)), None)
        if child.is_file() and ext is not None:
            counts[ext] += 1
    held = ", ".join(f"{n} {ext} file{'s' if n > 1 else ''}" for ext, n in counts.most_common())
    ext = counts.most_common(1)[0][0] if counts else ".jsonl"
    return (
        f"data file {str(directory)!r} is a directory (it holds {held or 'no .json, .jsonl or .parquet file'}); "
        f"pass its files with a glob, data_files: {str(directory / ('*' + ext))!r}, or a list of files"
    )


def _looks_like_hub_id(path: str) -> bool:
    name = path.removesuffix(".gz")
    known_suffix = any(name.endswith(ext) for ext in FILE_BUILDERS)
    return not known_suffix and not glob.has_magic(path) and not Path(path).exists()
