"""Token prompts of a conversation's turns, rendered with the tokenizer's chat template.

Turn ``k`` is asked after the user's earlier turns and the **target's own answers** to them (MT-Bench's
protocol: the second question, "rewrite your previous response...", refers to the model's first answer).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_drafts.serving.prompt_sets import Conversation


def turn_prompt(
    tokenizer: Any,
    conversation: Conversation,
    answers: Sequence[Sequence[int]],
    stop_token_ids: Iterable[int] = (),
    max_prompt_tokens: int | None = None,
) -> Tensor:
    """The prompt of turn ``len(answers) + 1``: the earlier user turns each followed by the target's answer
    (token ids, a trailing stop token dropped: the template closes the turn itself), then this turn's user
    text and the template's generation prompt. ``max_prompt_tokens`` keeps the last tokens."""
    turn = len(answers)
    if turn >= len(conversation.turns):
        raise ValueError(
            f"{conversation.prompt_set} {conversation.question_id} has {len(conversation.turns)} turns; "
            f"there is no turn {turn + 1}"
        )
    stop = set(stop_token_ids)
    messages: list[dict[str, str]] = []
    for question, answer in zip(conversation.turns, answers, strict=False):
        ids = list(answer)
        while ids and ids[-1] in stop:
            ids.pop()
        messages.append({"role": "user", "content": question})
        messages.append({"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)})
    messages.append({"role": "user", "content": conversation.turns[turn]})
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    # The template writes the special tokens itself; the tokenizer must not add a BOS of its own again.
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    prompt = torch.tensor(ids, dtype=torch.long)
    return prompt if max_prompt_tokens is None else prompt[-max_prompt_tokens:]
