"""The rules of the DFlash / DFlash2 hyperparameters an export carries in ``dflash_config``: the modules
check their arguments with them and ``validate_dflash_export`` checks the exported fields with them.

The DFlash2 conv sizes' rules belong to the conv (:mod:`lightning_drafts.blockdraft.conv`).
"""

from __future__ import annotations

from typing import Any

from lightning_drafts.core.checks import int_problem, is_int
from lightning_drafts.core.rules import FieldRule, int_rule

BLOCK_SIZE = int_rule("block_size", 2, hint="the anchor plus the drafted slots")
SELECTOR_RANK = int_rule("selector_rank", 1, hint="256 is the published default")


def layer_ids_problem(ids: Any, num_layers: Any) -> str | None:
    """A non-empty, strictly increasing list of the target decoder layers ``fc`` reads, each inside the
    target (unchecked where ``num_layers`` is not an int).

    Increasing because serving engines collect the captured states while looping over the target's layers,
    so ``fc``'s input chunks arrive in layer order there whatever order training used.
    """
    if not isinstance(ids, (list, tuple)) or not ids:
        return (
            f"{ids!r}; it must be the non-empty list of target decoder layers the draft's fc reads, in its "
            "column order (outputs, HF hidden_states[id + 1])"
        )
    not_ids = [i for i in ids if not is_int(i) or i < 0]
    if not_ids:
        return f"{list(ids)}; it must hold decoder-layer ids, ints >= 0 (offending: {not_ids})"
    outside = [i for i in ids if is_int(num_layers) and i >= num_layers]
    if outside:
        return (
            f"{list(ids)}; it names layers outside the target's {num_layers} decoder layers (offending: "
            f"{outside}; valid outputs: 0..{num_layers - 1}); ids are decoder-layer outputs, not HF "
            "hidden_states indices (no +1)"
        )
    if list(ids) != sorted(set(ids)):
        return (
            f"{list(ids)}; it must be strictly increasing ({sorted(set(ids))}): serving engines concatenate "
            "the captured states in layer order, so any other order would scramble fc's input at serving time"
        )
    return None


def selector_top_k_problem(value: Any, vocab_size: Any) -> str | None:
    """Candidates per slot: a positive int, at most the vocabulary."""
    problem = int_problem(value, 1, hint="16 is the published default")
    if problem is None and is_int(vocab_size) and value > vocab_size:
        return f"{value}; it exceeds the vocabulary ({vocab_size} tokens)"
    return problem


TARGET_LAYER_IDS = FieldRule("target_layer_ids", layer_ids_problem)
SELECTOR_TOP_K = FieldRule("selector_top_k", selector_top_k_problem)
