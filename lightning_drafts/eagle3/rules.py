"""The rule of the EAGLE-3 hyperparameter its export carries three times over (vLLM's, SGLang's and the
recorded training ids): the modules check ``target_layer_ids`` with it and ``validate_eagle3_export``
checks every exported copy with it."""

from __future__ import annotations

from typing import Any

from lightning_drafts.core.checks import is_int
from lightning_drafts.core.rules import FieldRule


def layer_ids_problem(ids: Any, num_layers: Any = None) -> str | None:
    """Three distinct, ascending, non-negative layer ids, inside a target of ``num_layers`` decoder layers
    (unchecked where ``num_layers`` is not an int).

    Ascending because serving engines gather the captured states while looping over layers, so ``fc``'s
    input chunks arrive in ascending layer order there.
    """
    if (
        not isinstance(ids, (list, tuple))
        or len(ids) != 3
        or not all(is_int(i) and i >= 0 for i in ids)
        or len(set(ids)) != 3
    ):
        return (
            f"{ids!r}; it must be three distinct, ascending, non-negative layer ids (decoder-layer outputs, "
            "HF hidden_states[id + 1])"
        )
    if is_int(num_layers) and max(ids) >= num_layers:
        return (
            f"{list(ids)}; it names layers outside the target's {num_layers} decoder layers (valid outputs: "
            f"0..{num_layers - 1}; ids name layer outputs, HF hidden_states[id + 1])"
        )
    if list(ids) != sorted(ids):
        return (
            f"{list(ids)}; it must be ascending ({sorted(ids)}): serving engines concatenate the captured "
            "states in layer order, so any other order would scramble fc's input at serving time"
        )
    return None


TARGET_LAYER_IDS = FieldRule("target_layer_ids", layer_ids_problem)
