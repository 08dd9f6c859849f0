"""The length limits of a served prompt: the tokens kept of a long prompt, and the target's positions.

A prompt longer than ``max_prompt_tokens`` keeps its last tokens (those next to the answer); the served
acceptance is then measured on cut prompts, which a user must be told, with the limit and the option that
raises it. A decode that would run past the target's ``max_position_embeddings`` measures a target outside
the positions it was trained for (RoPE extrapolates without a word): it is refused before any decode.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from torch import Tensor

from lightning_drafts.datamodules.setup_summary import show_console

logger = logging.getLogger("lightning_drafts.serving")


def cut_prompts(prompts: Sequence[Tensor], max_prompt_tokens: int | None) -> tuple[list[Tensor], int]:
    """``prompts`` each cut to its last ``max_prompt_tokens`` tokens (``None``: as they are), and how many
    were longer."""
    if max_prompt_tokens is None:
        return list(prompts), 0
    cut = sum(1 for p in prompts if p.numel() > max_prompt_tokens)
    return [p[-max_prompt_tokens:] for p in prompts], cut


def report_cut_prompts(cut: int, total: int, max_prompt_tokens: int | None) -> None:
    """Say that ``cut`` of ``total`` served prompts kept only their last ``max_prompt_tokens`` tokens."""
    if cut:
        show_console(logger)
        logger.warning(
            "evaluate: %d of %d prompts were longer than max_prompt_tokens=%d and were served with their "
            "last %d tokens only; raise the limit with --max-prompt-tokens",
            cut,
            total,
            max_prompt_tokens,
            max_prompt_tokens,
        )


def check_positions(
    prompts: Sequence[Tensor], max_new_tokens: int, num_steps: int, max_positions: int | None
) -> None:
    """Refuse prompts whose decode would pass ``max_positions`` (the target's ``max_position_embeddings``):
    the last verify round runs the target over the prompt, ``max_new_tokens - 1`` emitted tokens and
    ``num_steps`` proposed ones."""
    if max_positions is None:
        return
    for index, prompt in enumerate(prompts):
        longest = prompt.numel() + max_new_tokens - 1 + num_steps
        if longest > max_positions:
            raise ValueError(
                f"prompt {index + 1} of {len(prompts)} has {prompt.numel()} tokens: with max_new_tokens="
                f"{max_new_tokens} and num_steps={num_steps} the target would run over {longest} positions, "
                f"past its max_position_embeddings={max_positions}; lower --max-new-tokens or "
                "--max-prompt-tokens"
            )
