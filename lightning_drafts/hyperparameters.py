"""Checks of the hyperparameters several draft families share, failing at construction with a fix."""

from __future__ import annotations

from typing import Any


def check_positive_int(name: str, value: Any) -> None:
    """``value`` must be an int >= 1 (``bool`` is refused: ``True`` is not a count)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} = {value!r} must be a positive int")


def check_mask_token_id(mask_token_id: Any, vocab_size: int, special: dict[str, Any] | None = None) -> int:
    """The reserved id of block drafts' masked slots: required (no fallback to pad / eos), in the
    vocabulary, and none of the ``special`` ids (name -> id, a list of ids or None), e.g. the
    tokenizer's pad and the target's eos: a mask that is also a real token would be fed and predicted."""
    if mask_token_id is None:
        raise ValueError(
            "mask_token_id is required: pass a reserved, otherwise unused token id of the target vocabulary "
            "(e.g. 151669 for Qwen3, 248070 for Qwen3.5+); never pad or eos"
        )
    if (
        isinstance(mask_token_id, bool)
        or not isinstance(mask_token_id, int)
        or not 0 <= mask_token_id < vocab_size
    ):
        raise ValueError(
            f"mask_token_id = {mask_token_id!r} is outside the target vocabulary [0, {vocab_size})"
        )
    for name, ids in (special or {}).items():
        if mask_token_id in (ids if isinstance(ids, list | tuple) else [ids]):
            raise ValueError(
                f"mask_token_id = {mask_token_id} is also the {name}; pick a reserved, otherwise unused id"
            )
    return mask_token_id


def special_token_ids(config: Any, pad_token_id: int | None) -> dict[str, Any]:
    """The ids a block draft's mask must not be: the data's pad id and the target config's pad / bos / eos."""
    found = {
        f"target's {name}": getattr(config, name, None)
        for name in ("pad_token_id", "bos_token_id", "eos_token_id")
    }
    return {"tokenizer's pad_token_id": pad_token_id, **found}
