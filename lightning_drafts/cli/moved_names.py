"""Names a config could use that have moved, refused with the new name.

* Class paths of the old top-level ``datamodules`` / ``callbacks`` packages: those folders install as
  ``lightning_drafts.datamodules`` and ``lightning_drafts.callbacks``; a config written before that would
  otherwise fail deep inside argument parsing with an import error that never says what to write instead.
* The target workers' options, once flat model arguments (``target_workers``, ...), now the ``remote``
  block (``remote.workers``, ...); jsonargparse would say only that the option "is not accepted".
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lightning_drafts.cli.fit_config import read_yaml
from lightning_drafts.training.remote.config import RETIRED_NAMES

MOVED_PACKAGES = ("datamodules", "callbacks")


def refuse_moved_class_paths(args: list[str]) -> None:
    """Raise ``ValueError`` naming the new class path for any old one in ``args`` or their ``--config`` files."""
    for where, value in _class_path_values(args):
        package = value.split(".", 1)[0]
        if package in MOVED_PACKAGES and "." in value:
            raise ValueError(
                f"{where} names {value!r}: the {package} package is now lightning_drafts.{package}; write "
                f"'lightning_drafts.{value}'"
            )


def refuse_retired_options(args: list[str]) -> None:
    """Raise ``ValueError`` naming the ``remote`` option for a flat target-worker option in ``args`` or their
    ``--config`` files."""
    for index, arg in enumerate(args):
        name, _, value = arg.partition("=")
        if name == "--config" and not value and index + 1 < len(args):
            value = args[index + 1]
        if name == "--config" and Path(value).is_file():
            config = read_yaml(value)
            model = config.get("model") if isinstance(config, dict) else None
            init_args = model.get("init_args") if isinstance(model, dict) else None
            found = [key for key in (init_args or {}) if key in RETIRED_NAMES]
            where, prefix = f"{value}: ", "model.init_args"
        else:
            option = name.removeprefix("--model.init_args.")
            found = [option] if option != name and option in RETIRED_NAMES else []
            where, prefix = "", "--model.init_args"
        if found:
            raise ValueError(
                f"{where}{prefix}.{found[0]} is now {prefix}.remote.{RETIRED_NAMES[found[0]]} (the target "
                "workers' options are one `remote` block); write it there"
            )


def _class_path_values(args: list[str]) -> Iterator[tuple[str, str]]:
    for index, arg in enumerate(args):
        name, _, value = arg.partition("=")
        if name == "--config" and not value and index + 1 < len(args):
            value = args[index + 1]
        if name == "--config" and Path(value).is_file():
            for found in _strings_under_class_path(read_yaml(value)):
                yield value, found
        elif name.startswith("--") and value:
            yield name, value


def _strings_under_class_path(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "class_path" and isinstance(value, str):
                yield value
            else:
                yield from _strings_under_class_path(value)
    elif isinstance(node, list):
        for value in node:
            yield from _strings_under_class_path(value)
