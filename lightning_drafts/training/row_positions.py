"""A packed row's documents must fit the target's positions.

A document is up to ``max_tokens`` long and its positions restart at 0, so its last token sits at
position ``max_tokens - 1``. A target trained with ``max_position_embeddings`` positions has no learned
or calibrated position past that (a learned table has no row for it; RoPE scaling is tuned for that
length), so its features there, and a draft trained on them, are wrong without any error.
"""

from __future__ import annotations

from typing import Any


def check_row_positions(max_tokens: Any, target_config: Any) -> None:
    """Refuse a row width ``max_tokens`` longer than ``target_config.max_position_embeddings`` (unchecked
    where either is unknown: a user's data module without ``max_tokens``, a config that declares no
    position limit)."""
    positions = getattr(target_config, "max_position_embeddings", None)
    if not isinstance(max_tokens, int) or not isinstance(positions, int) or max_tokens <= positions:
        return
    raise ValueError(
        f"max_tokens = {max_tokens} is longer than the target's max_position_embeddings = {positions}: a "
        f"document's tokens past position {positions - 1} would be placed where the target has no position; "
        f"set data.init_args.max_tokens to at most {positions}"
    )
