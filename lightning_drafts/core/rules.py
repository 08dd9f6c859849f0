"""Field rules: a rule about one hyperparameter / config field, stated once and applied in two places.

A module's constructor checks its argument with :meth:`FieldRule.check` (a ``ValueError`` at once) and an
export validator checks the same field in ``config.json`` with :meth:`FieldRule.report` (one defect among
all those it lists), so what the trainer refuses and what the validator refuses cannot drift apart.

The rule's ``problem(value, **context)`` returns ``None`` or the problem text: the offending value
first, then what is wrong and how to fix it (``"1; it must be an int >= 2 (the anchor plus the drafted
slots)"``). ``context`` carries what the rule compares against (the target's vocabulary size and layer
count, the block size, ...), passed by name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from lightning_drafts.core.checks import int_problem


class Defects(Protocol):
    """Where a validator collects what is wrong (:class:`~lightning_drafts.serving.export_files.DefectList`)."""

    def add(self, name: str, problem: str) -> None: ...


@dataclass(frozen=True)
class FieldRule:
    """``field``'s rule; ``problem(value, **context)`` is ``None`` when ``value`` is fine."""

    field: str
    problem: Callable[..., str | None]

    def check(self, value: Any, **context: Any) -> Any:
        """Construction: ``value`` itself, or ``ValueError("<field> = <problem>")``."""
        problem = self.problem(value, **context)
        if problem is not None:
            raise ValueError(f"{self.field} = {problem}")
        return value

    def report(self, defects: Defects, value: Any, name: str | None = None, **context: Any) -> bool:
        """Validation: add ``("<name>", "is <problem>")`` to ``defects`` (``name`` is where the field sits in
        ``config.json``, the field itself by default); ``True`` when ``value`` is fine."""
        problem = self.problem(value, **context)
        if problem is not None:
            defects.add(name or self.field, f"is {problem}")
        return problem is None

    def report_field(
        self, defects: Defects, section: Mapping[str, Any], prefix: str = "", **context: Any
    ) -> bool:
        """:meth:`report` of the field as it sits in ``section`` of ``config.json`` (``prefix``: the
        section's dotted path, e.g. ``"dflash_config."``, naming the defect)."""
        return self.report(defects, section.get(self.field), prefix + self.field, **context)


def int_rule(field: str, minimum: int | None = None, maximum: int | None = None, hint: str = "") -> FieldRule:
    """The rule that ``field`` is an int in ``[minimum, maximum]`` (``hint``: what it counts, a default)."""
    return FieldRule(field, lambda value: int_problem(value, minimum, maximum, hint))
