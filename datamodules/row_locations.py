"""Where a row of a chat source came from, for messages about rows found malformed at tokenisation.

Rows are tokenised as one ``datasets`` table, in source order, so a row is known there by its index.
This turns the few indices a message names into the names the row-by-row JSON reader gave its rows
(``file:line`` for JSON Lines, ``file[i]`` for a JSON array), ``file row i`` (Parquet) or ``<source> row
i`` (a hub dataset, the embedded corpus). Parquet files are read again only when a message needs a
location, and only their row counts.
"""

from __future__ import annotations

import glob
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RowLocations:
    """The source of a tokenised table: its rows' own names (the row-by-row reader), its files in the
    order ``datasets`` read them, or only a name."""

    name: str
    files: tuple[Path, ...] = ()
    listed: tuple[str, ...] = ()

    @classmethod
    def of_files(cls, paths: Iterable[str]) -> RowLocations:
        """The files of ``data_files`` in ``datasets``' order: each pattern's matches sorted, patterns in turn."""
        ordered = [Path(m) for p in paths for m in (sorted(glob.glob(p)) if glob.has_magic(p) else [p])]
        return cls(name=", ".join(str(p) for p in paths), files=tuple(ordered))

    def describe(self, indices: Iterable[int]) -> dict[int, str]:
        """``index -> location`` for ``indices`` (rows of the tokenised table)."""
        wanted = sorted(set(indices))
        if self.listed:
            return {i: self.listed[i] for i in wanted}
        if not self.files:
            return {i: f"{self.name} row {i}" for i in wanted}
        found: dict[int, str] = {}
        rows = _file_rows(self.files)
        for index, where in enumerate(rows):
            if index in wanted:
                found[index] = where
            if len(found) == len(wanted) or index >= wanted[-1]:
                break
        return {i: found.get(i, f"{self.name} row {i}") for i in wanted}


def _file_rows(files: tuple[Path, ...]) -> Iterator[str]:
    import pyarrow.parquet as pq

    for path in files:
        yield from (f"{path} row {i}" for i in range(pq.ParquetFile(path).metadata.num_rows))
