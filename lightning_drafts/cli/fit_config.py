"""A ``fit`` config read outside LightningCLI, by the subcommands that reuse its target and data
(``evaluate``, ``regenerate``) without building its draft (a real target is large, and these need only its
id and the data settings). They take ``fit``'s dotted overrides too (``--data.init_args.max_documents=100``),
so one config and the same command-line changes serve every subcommand."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CONFIG_SUFFIXES = (".json", ".yaml", ".yml")


def read_config(path: str | Path) -> dict[str, Any]:
    """The JSON / YAML config at ``path`` as a dict."""
    path = Path(path)
    if not path.is_file() or path.suffix not in CONFIG_SUFFIXES:
        raise ValueError(f"{path} is not a JSON / YAML file ({CONFIG_SUFFIXES})")
    if path.suffix == ".json":
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise ValueError(
                f"{path}:{error.lineno}: invalid JSON ({error.msg} at column {error.colno})"
            ) from error
    return read_yaml(path) or {}


def read_yaml(path: str | Path) -> Any:
    """The YAML document at ``path``; a syntax error is a ``ValueError`` that names the file, line and
    column (PyYAML names only ``<unicode string>``)."""
    import yaml

    try:
        return yaml.safe_load(Path(path).read_text())
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        context = error.context or ""
        if context and error.context_mark is not None and error.context_mark is not mark:
            context += f" (line {error.context_mark.line + 1})"
        problem = ", ".join(part for part in (context, error.problem) if part)
        raise ValueError(f"{where}: YAML syntax error: {problem}; fix the file there") from None
    except yaml.YAMLError as error:
        raise ValueError(f"{path}: not readable as YAML ({error})") from None


def read_config_with_overrides(path: str | Path, overrides: Sequence[str]) -> dict[str, Any]:
    """The config at ``path`` with ``overrides`` applied: ``--a.b.c=VALUE`` or ``--a.b.c VALUE`` items, as
    ``fit`` takes them (the value read as YAML: ``100`` an int, ``[a, b]`` a list, ``null`` None)."""
    import yaml

    config = read_config(path)
    items = list(overrides)
    while items:
        item = items.pop(0)
        key, equals, value = item.partition("=")
        if not key.startswith("--") or "." not in key:
            raise ValueError(
                f"unknown argument {item!r}; a config override is written --section.key=VALUE, e.g. "
                "--data.init_args.max_documents=100"
            )
        if not equals:
            if not items or items[0].startswith("--"):
                raise ValueError(f"{key} needs a value: {key}=VALUE")
            value = items.pop(0)
        *parents, leaf = key[2:].split(".")
        section = config
        for name in parents:
            child = section.setdefault(name, {})
            if not isinstance(child, dict):
                raise ValueError(f"{key}: {name} is {child!r} in {path}, not a section to set {leaf} in")
            section = child
        section[leaf] = yaml.safe_load(value)
    return config


def target_spec(target: str | None, config: dict[str, Any]) -> tuple[Any, int | None]:
    """``(spec, seed)`` from ``--target`` (id, path or config file) or the ``--config`` model section."""
    if target is not None and Path(target).suffix in CONFIG_SUFFIXES and Path(target).is_file():
        config = read_config(target)
        if "model_type" in config:
            return config, None
    elif target is not None:
        return target, None
    init_args = (config.get("model") or {}).get("init_args") or {}
    if target is not None and "target" not in init_args:
        raise ValueError(
            f"--target {target} holds neither a target config dict (with model_type) nor model.init_args.target"
        )
    if "target" not in init_args:
        return None, None  # the target the export records
    spec = init_args["target"]
    if isinstance(spec, dict) and "vocab_size" not in spec:
        # The fit CLI links the tokenizer's vocabulary into a config-dict target; do the same.
        spec = {**spec, "vocab_size": config_datamodule(config).vocab_size}
    return spec, init_args.get("target_seed")


def config_datamodule(config: dict[str, Any], **overrides: Any) -> Any:
    """The config's ``PackedChatDataModule`` (its ``data.init_args``, with ``overrides``)."""
    from lightning_drafts.datamodules import PackedChatDataModule

    return PackedChatDataModule(**{**(((config.get("data") or {}).get("init_args")) or {}), **overrides})
