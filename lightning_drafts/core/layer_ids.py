"""The one rule for the target layers a draft's ``fc`` reads (``target_layer_ids``), parametrised per
family: how many ids, the lowest id the family can capture, and what an id names.

Every family needs the same three things: the ids are ints inside the target, and strictly increasing,
because serving engines collect the captured states while looping over the target's layers, so ``fc``'s
input chunks arrive in layer order there whatever order training used (any other order would scramble
``fc``'s input at serving time).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lightning_drafts.core.checks import is_int
from lightning_drafts.core.rules import FieldRule


def layer_ids_rule(
    describe: str,
    count: int | None = None,
    lowest: int = 0,
    noun: str = "layers",
    valid: Callable[[int], str] = lambda layers: f"valid outputs: 0..{layers - 1}",
) -> FieldRule:
    """The ``target_layer_ids`` rule: ``count`` ids (any non-empty number when ``None``), each an int in
    ``[lowest, num_layers - 1]`` (the upper bound unchecked where ``num_layers`` is not an int), strictly
    increasing. ``describe`` says what the list is, ``noun`` what an id names and ``valid(num_layers)``
    which ids a target of that depth offers, for the error texts."""

    def problem(ids: Any, num_layers: Any = None) -> str | None:
        if not isinstance(ids, (list, tuple)) or not ids or (count is not None and len(ids) != count):
            return f"{ids!r}; it must be {describe}"
        not_ids = [i for i in ids if not is_int(i)]
        if not_ids:
            return f"{list(ids)}; it must hold int ids (offending: {not_ids})"
        outside = [i for i in ids if i < lowest or (is_int(num_layers) and i >= num_layers)]
        if outside:
            depth = f"the target's {num_layers} decoder layers" if is_int(num_layers) else "the target"
            where = f"; {valid(num_layers)}" if is_int(num_layers) else f"; ids start at {lowest}"
            return f"{list(ids)}; it names {noun} outside {depth} (offending: {outside}{where})"
        if list(ids) != sorted(set(ids)):
            return (
                f"{list(ids)}; it must be strictly increasing ({sorted(set(ids))}): serving engines "
                "concatenate the captured states in layer order, so any other order would scramble fc's "
                "input at serving time"
            )
        return None

    return FieldRule("target_layer_ids", problem)
