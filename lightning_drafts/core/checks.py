"""Value checks stated once: the int-not-bool and number-not-bool tests and the integer / range problem
whose text names the offending value. Module construction and export validators share them.

A problem text starts with the offending value (``"0; it must be a positive int"``): a constructor says
``num_anchors = <problem>``, an export validator ``num_anchors: is <problem>``.
"""

from __future__ import annotations

from typing import Any


def is_int(value: Any) -> bool:
    """An int that is not a bool (``True`` is not a count, a size or an id)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """An int or a float that is not a bool (``True`` is not a rate, a weight or a RoPE base)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def int_problem(
    value: Any, minimum: int | None = None, maximum: int | None = None, hint: str = ""
) -> str | None:
    """Why ``value`` is not an int in ``[minimum, maximum]`` (either bound optional), or ``None``;
    ``hint`` (what the number counts, a default) goes in parentheses after the requirement."""
    if is_int(value) and (minimum is None or value >= minimum) and (maximum is None or value <= maximum):
        return None
    return f"{value!r}; it must be {_int_kind(minimum, maximum)}" + (f" ({hint})" if hint else "")


def check_int(
    name: str, value: Any, minimum: int | None = None, maximum: int | None = None, hint: str = ""
) -> int:
    """``value`` itself when it is an int in ``[minimum, maximum]``, else a ``ValueError`` naming it."""
    problem = int_problem(value, minimum, maximum, hint)
    if problem is not None:
        raise ValueError(f"{name} = {problem}")
    return value


def check_bool(name: str, value: Any) -> bool:
    """``value`` itself when it is a bool (a switch: ``1`` or ``"yes"`` is a typo, not on), else a
    ``ValueError`` naming it."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} = {value!r}; it must be True or False")
    return value


def _int_kind(minimum: int | None, maximum: int | None) -> str:
    if minimum is not None and maximum is not None:
        return f"an int in [{minimum}, {maximum}]"
    if minimum == 1:
        return "a positive int"
    if minimum is not None:
        return f"an int >= {minimum}"
    if maximum is not None:
        return f"an int <= {maximum}"
    return "an int"


def check_number(
    name: str,
    value: Any,
    minimum: float | None = None,
    maximum: float | None = None,
    above_minimum: bool = False,
    below_maximum: bool = False,
) -> float:
    """``value`` itself when it is a finite number in the given range (bounds inclusive unless
    ``above_minimum`` / ``below_maximum``), else a ``ValueError`` naming it and the range."""
    low = "" if minimum is None else f"{'>' if above_minimum else '>='} {minimum}"
    high = "" if maximum is None else f"{'<' if below_maximum else '<='} {maximum}"
    fine = is_number(value) and value == value and abs(value) != float("inf")
    if fine and minimum is not None:
        fine = value > minimum if above_minimum else value >= minimum
    if fine and maximum is not None:
        fine = value < maximum if below_maximum else value <= maximum
    if not fine:
        bounds = " and ".join(b for b in (low, high) if b)
        raise ValueError(f"{name} = {value!r}; it must be a number{' ' + bounds if bounds else ''}")
    return value
