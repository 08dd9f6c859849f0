"""The rules of the DFlash / DFlash2 hyperparameters an export carries in ``dflash_config``: the modules
check their arguments with them and ``validate_dflash_export`` checks the exported fields with them.

The DFlash2 conv sizes' rules belong to the conv (:mod:`lightning_drafts.blockdraft.conv`).
"""

from __future__ import annotations

from typing import Any

from lightning_drafts.core.checks import int_problem, is_int
from lightning_drafts.core.layer_ids import layer_ids_rule
from lightning_drafts.core.rules import FieldRule, int_rule

BLOCK_SIZE = int_rule("block_size", 2, hint="the anchor plus the drafted slots")
SELECTOR_RANK = int_rule("selector_rank", 1, hint="256 is the published default")


def selector_top_k_problem(value: Any, vocab_size: Any) -> str | None:
    """Candidates per slot: a positive int, at most the vocabulary."""
    problem = int_problem(value, 1, hint="16 is the published default")
    if problem is None and is_int(vocab_size) and value > vocab_size:
        return f"{value}; it exceeds the vocabulary ({vocab_size} tokens)"
    return problem


TARGET_LAYER_IDS = layer_ids_rule(
    "the non-empty list of target decoder layers the draft's fc reads, in its column order (decoder-layer "
    "outputs, HF hidden_states[id + 1]; no +1)"
)
SELECTOR_TOP_K = FieldRule("selector_top_k", selector_top_k_problem)
