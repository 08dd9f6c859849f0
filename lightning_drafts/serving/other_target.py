"""An export served with another target than the one it was trained for: its refusal names both.

The validator's defects say which field differs (``target_hidden_size: is 32 but the target has 48``), not
which two models were involved; a user who passed ``--target`` by mistake (a sibling checkpoint, another
size of the family) needs both names to see it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any


def target_name(spec: Any) -> str:
    """A hub id or path as given; a config dict (or a model, or a FrozenTarget) by its type and sizes."""
    if isinstance(spec, (str, Path)):
        return str(spec)
    if isinstance(spec, Mapping):
        config = dict(spec)
    else:
        model = getattr(spec, "model", spec)
        config = model.config.to_dict() if hasattr(model, "config") else {}
        if config.get("name_or_path"):
            return str(config["name_or_path"])
    return (
        f"a {config.get('model_type', 'model')} config (hidden_size {config.get('hidden_size')}, "
        f"{config.get('num_hidden_layers')} layers, vocab_size {config.get('vocab_size')})"
    )


def naming_both_targets(directory: Path, recorded: Any, given: Any, error: ValueError) -> ValueError:
    """``error`` (an export refused against the ``given`` target) with a first line naming the target the
    export records (``recorded``) and the one given."""
    return ValueError(
        f"{directory} was trained for {target_name(recorded)}, but the target given is {target_name(given)}; "
        f"evaluate it with the target it was trained for (leave the target out to load the one it records)\n"
        f"{error}"
    )
