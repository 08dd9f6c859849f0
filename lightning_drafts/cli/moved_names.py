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


def refuse_moved_names(args: list[str]) -> None:
    """Raise ``ValueError`` naming the new name for any moved one in ``args`` or their ``--config`` files
    (each file read once)."""
    for name, value, config in _given(args):
        if config is None:
            option = name.removeprefix("--model.init_args.")
            retired = [option] if option != name and option in RETIRED_NAMES else []
            source, where, prefix, class_paths = name, "", "--model.init_args", [value] if value else []
        else:
            model = config.get("model") if isinstance(config, dict) else None
            init_args = model.get("init_args") if isinstance(model, dict) else None
            retired = [key for key in (init_args or {}) if key in RETIRED_NAMES]
            source, where, prefix, class_paths = (
                value,
                f"{value}: ",
                "model.init_args",
                list(_strings_under_class_path(config)),
            )
        for class_path in class_paths:
            package = class_path.split(".", 1)[0]
            if package in MOVED_PACKAGES and "." in class_path:
                raise ValueError(
                    f"{source} names {class_path!r}: the {package} package is now "
                    f"lightning_drafts.{package}; write 'lightning_drafts.{class_path}'"
                )
        if retired:
            raise ValueError(
                f"{where}{prefix}.{retired[0]} is now {prefix}.remote.{RETIRED_NAMES[retired[0]]} (the target "
                "workers' options are one `remote` block); write it there"
            )


def _given(args: list[str]) -> Iterator[tuple[str, str, Any]]:
    """``(option, value, None)`` for each ``--option[=value]`` of ``args``, and ``("--config", path, the
    parsed file)`` for each config file they name."""
    for index, arg in enumerate(args):
        name, _, value = arg.partition("=")
        if name == "--config" and not value and index + 1 < len(args):
            value = args[index + 1]
        if name == "--config" and Path(value).is_file():
            yield name, value, read_yaml(value)
        elif name.startswith("--"):
            yield name, value, None


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
