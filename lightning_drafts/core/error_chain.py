"""The errors behind an error: what it was raised from, or while handling, as Python's traceback shows them."""

from __future__ import annotations

from collections.abc import Iterator


def error_chain(error: BaseException) -> Iterator[BaseException]:
    """``error``, then the error it was raised from (``__cause__``) or while handling (``__context__``, unless
    suppressed by ``raise ... from None``), and so on; each once."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
