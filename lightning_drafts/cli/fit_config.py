"""A ``fit`` config read outside LightningCLI, by the subcommands that reuse its target and data
(``evaluate``, ``regenerate``) without building its draft."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CONFIG_SUFFIXES = (".json", ".yaml", ".yml")


def read_config(path: str | Path) -> dict[str, Any]:
    """The JSON / YAML config at ``path`` as a dict."""
    path = Path(path)
    if not path.is_file() or path.suffix not in CONFIG_SUFFIXES:
        raise ValueError(f"{path} is not a JSON / YAML file ({CONFIG_SUFFIXES})")
    if path.suffix == ".json":
        return json.loads(path.read_text())
    import yaml

    return yaml.safe_load(path.read_text()) or {}


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
