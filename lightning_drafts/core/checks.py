"""Value checks stated once: the int-not-bool test and integer / range checks whose errors name the
offending value. Module construction and export validators share them."""

from __future__ import annotations

from typing import Any


def is_int(value: Any) -> bool:
    """An int that is not a bool (``True`` is not a count, a size or an id)."""
    return isinstance(value, int) and not isinstance(value, bool)


def int_problem(value: Any, minimum: int | None = None, maximum: int | None = None) -> str | None:
    """Why ``value`` is not an int in ``[minimum, maximum]`` (either bound optional), or ``None``."""
    if not is_int(value):
        return f"is {value!r}; it must be an int"
    if minimum is not None and value < minimum:
        return f"is {value}; it must be >= {minimum}"
    if maximum is not None and value > maximum:
        return f"is {value}; it must be <= {maximum}"
    return None


def check_int(name: str, value: Any, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` itself when it is an int in ``[minimum, maximum]``, else a ``ValueError`` naming it."""
    problem = int_problem(value, minimum, maximum)
    if problem is not None:
        raise ValueError(f"{name} {problem}")
    return value
