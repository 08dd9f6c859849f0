"""Which token ids a block draft may reserve as its mask token: ones text never produces.

A reserved id is a special or added token of the tokenizer (other than its eos / bos / pad / unk) or an id
past the tokenizer's tokens (an unused embedding row, as Qwen3's 151669). An ordinary text token is refused
even where the data lacks it (the next data or a served prompt holds it), and so is any id that occurs in
the documents.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import islice

from transformers import PreTrainedTokenizerBase

# How many unused special or added tokens a refusal offers instead.
OFFERED = 5


def reserved_id_problem(
    tokenizer: PreTrainedTokenizerBase, token_id: int, occurrences: Callable[[int], int]
) -> str | None:
    """Why ``token_id`` cannot be a reserved id of ``tokenizer``, or ``None``; ``occurrences(id)`` counts an
    id in the documents (0 before they are read)."""
    named: dict[int | None, str] = {}
    for name in ("eos", "bos", "pad", "unk"):
        named.setdefault(getattr(tokenizer, f"{name}_token_id"), name)
    if token_id in named:
        name = named[token_id]
        return f"the tokenizer's {name} token {getattr(tokenizer, f'{name}_token')!r}"
    count = occurrences(token_id)
    occurs = f", which occurs {count:,} times in the data" if count else ""
    reserved = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    if 0 <= token_id < len(tokenizer) and token_id not in reserved:
        unused = (i for i in sorted(reserved - set(named)) if not occurrences(i))
        listed = ", ".join(f"{i} {tokenizer.convert_ids_to_tokens(i)!r}" for i in islice(unused, OFFERED))
        return (
            f"token {tokenizer.convert_ids_to_tokens(token_id)!r}{occurs}: an ordinary text token of the "
            f"tokenizer; pick a special or added token the data never uses ({listed or 'it has none'}) or "
            f"an id past its {len(tokenizer):,} tokens"
        )
    if count:
        return f"token {tokenizer.convert_ids_to_tokens(token_id)!r}{occurs}"
    return None
