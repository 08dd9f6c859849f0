"""The rule of the hyperparameter every block-draft family shares, the reserved mask token: checked when a
module is built and again, on the exported id, by the family's export validator."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from lightning_drafts.core.checks import is_int
from lightning_drafts.core.rules import FieldRule

if TYPE_CHECKING:
    from lightning_drafts.training.target import FrozenTarget


def mask_token_problem(value: Any, vocab_size: Any, special: Mapping[int, str]) -> str | None:
    """A mask id is inside the vocabulary ``[0, vocab_size)`` (unchecked where ``vocab_size`` is not an
    int) and none of the ``special`` ids (``id -> what it is``): a mask that is also a real token would
    be fed and predicted."""
    if not is_int(value):
        return (
            f"{value!r}; it must be the reserved token id the draft trains with, inside the target "
            f"vocabulary [0, {vocab_size})"
        )
    if is_int(vocab_size) and not 0 <= value < vocab_size:
        return f"{value}; it is outside the target vocabulary [0, {vocab_size}): pick a reserved id inside it"
    if value in special:
        return (
            f"{value}, {special[value]}; the mask must be a reserved id the target never emits (e.g. 151669 "
            "for Qwen3), or drafted blocks read as real text"
        )
    return None


MASK_TOKEN_ID = FieldRule("mask_token_id", mask_token_problem)


def special_token_names(target: FrozenTarget, pad_token_id: int | None = None) -> dict[int, str]:
    """``id -> what it is`` for the ids a mask must not be: the tokenizer's ``pad_token_id`` and the
    target's pad / bos / eos ids."""
    special = {} if pad_token_id is None else {pad_token_id: "the tokenizer's pad_token_id"}
    for token, name in target.special_token_ids().items():
        special.setdefault(token, f"the target's {name} token")
    return special


def check_mask_token_id(mask_token_id: Any, target: FrozenTarget, pad_token_id: int | None = None) -> int:
    """The reserved id of block drafts' masked slots: required (no fallback to pad / eos), then
    :data:`MASK_TOKEN_ID` against ``target`` and the tokenizer's ``pad_token_id``."""
    if mask_token_id is None:
        raise ValueError(
            "mask_token_id is required: pass a reserved, otherwise unused token id of the target vocabulary "
            "(e.g. 151669 for Qwen3, 248070 for Qwen3.5+); never pad or eos"
        )
    special = special_token_names(target, pad_token_id)
    return MASK_TOKEN_ID.check(mask_token_id, vocab_size=target.vocab_size, special=special)


def check_mask_token_against_data(mask_token_id: int, datamodule: Any) -> None:
    """Refuse a mask id the tokenizer or the documents use (checked once the data is known, at fit start):
    the draft would learn that a masked slot and a real token are the same input. A data module without
    ``reserved_id_problem`` (a user's own) is not checked."""
    problem = getattr(datamodule, "reserved_id_problem", None)
    reason = problem(mask_token_id) if problem is not None else None
    if reason is not None:
        raise ValueError(
            f"mask_token_id = {mask_token_id} is {reason}; the mask must be a reserved id that never occurs "
            "in text (e.g. 151669 for Qwen3, 3 '<|mask|>' for the shipped tiny targets)"
        )
