"""Checks of the hyperparameters several draft families share, failing at construction with a fix."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_drafts.training.target import FrozenTarget


def check_positive_int(name: str, value: Any) -> None:
    """``value`` must be an int >= 1 (``bool`` is refused: ``True`` is not a count)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} = {value!r} must be a positive int")


def check_mask_token_id(mask_token_id: Any, target: FrozenTarget, pad_token_id: int | None = None) -> int:
    """The reserved id of block drafts' masked slots: required (no fallback to pad / eos), in the target's
    vocabulary, and neither the tokenizer's ``pad_token_id`` nor one of the target's pad / bos / eos ids:
    a mask that is also a real token would be fed and predicted."""
    if mask_token_id is None:
        raise ValueError(
            "mask_token_id is required: pass a reserved, otherwise unused token id of the target vocabulary "
            "(e.g. 151669 for Qwen3, 248070 for Qwen3.5+); never pad or eos"
        )
    vocab_size = target.vocab_size
    if (
        isinstance(mask_token_id, bool)
        or not isinstance(mask_token_id, int)
        or not 0 <= mask_token_id < vocab_size
    ):
        raise ValueError(
            f"mask_token_id = {mask_token_id!r} is outside the target vocabulary [0, {vocab_size})"
        )
    special = {pad_token_id: "tokenizer's pad_token_id"}
    for token, name in target.special_token_ids().items():
        special.setdefault(token, f"target's {name}_token_id")
    if mask_token_id in special:
        raise ValueError(
            f"mask_token_id = {mask_token_id} is also the {special[mask_token_id]}; pick a reserved, "
            "otherwise unused id"
        )
    return mask_token_id
