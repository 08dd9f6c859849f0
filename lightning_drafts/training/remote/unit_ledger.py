"""Work units and the ledger that trains on each exactly once.

A :class:`Unit` is one planned micro-batch: the plan is deterministic for a seed and epoch, so a unit not
yet trained can always be computed again and nothing has to be stored. The :class:`UnitLedger` follows the
units one trainer rank asked its target workers for: in flight (sent, no result yet), ready (a result,
not yet trained on) and consumed. It accepts the first result of each unit and drops every later one (a
duplicate: a second attempt finishing after the first) or one it never asked for (stale: from before a
resume or a restart), and it counts the bytes that are in flight or ready, which the sender keeps under
a cap.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True, order=True)
class Unit:
    """Micro-batch ``micro`` of optimizer step ``step`` (counted within the epoch) of rank ``rank`` in
    ``epoch`` of the ``split`` (for ``"val"``, ``epoch`` counts the validation runs)."""

    split: str
    epoch: int
    step: int
    rank: int
    micro: int

    def __str__(self) -> str:
        return (
            f"{self.split} unit (epoch {self.epoch}, step {self.step}, rank {self.rank}, "
            f"micro-batch {self.micro})"
        )


def tensor_bytes(tensors: Mapping[str, Tensor]) -> int:
    return sum(int(t.numel()) * t.element_size() for t in tensors.values())


class UnitLedger:
    """The units of one trainer rank: in flight, ready, consumed (see the module docstring)."""

    def __init__(self) -> None:
        self.in_flight: dict[Unit, int] = {}
        self.ready: dict[Unit, dict[str, Tensor]] = {}
        self.consumed: set[Unit] = set()
        self.dropped: Counter[str] = Counter()
        self.peak_bytes = 0
        self.peak_units = 0

    @property
    def bytes(self) -> int:
        """Bytes in flight (as expected when sent) plus the bytes of ready results."""
        return sum(self.in_flight.values()) + sum(tensor_bytes(r) for r in self.ready.values())

    @property
    def units(self) -> int:
        return len(self.in_flight) + len(self.ready)

    def known(self, unit: Unit) -> bool:
        return unit in self.in_flight or unit in self.ready or unit in self.consumed

    def sent(self, unit: Unit, expected_bytes: int) -> None:
        if self.known(unit):
            raise ValueError(f"{unit} was already sent; a unit is sent once and re-sent only as a retry")
        self.in_flight[unit] = int(expected_bytes)
        self._note_peak()

    def arrived(self, unit: Unit, features: dict[str, Tensor]) -> bool:
        """Take ``unit``'s result; ``False`` (and counted in ``dropped``) for a duplicate or a stale one."""
        if unit in self.ready or unit in self.consumed:
            self.dropped["duplicate"] += 1
            return False
        if unit not in self.in_flight:
            self.dropped["stale"] += 1
            return False
        del self.in_flight[unit]
        self.ready[unit] = features
        self._note_peak()
        return True

    def take(self, unit: Unit) -> dict[str, Tensor]:
        """``unit``'s result, once: it is consumed."""
        if unit in self.consumed:
            raise ValueError(f"{unit} was already trained on; a unit is consumed once")
        if unit not in self.ready:
            raise ValueError(f"{unit} has no result yet")
        self.consumed.add(unit)
        return self.ready.pop(unit)

    def forget(self, split: str) -> list[Unit]:
        """Give up the units of ``split`` not trained on (a validation run that ended before them): their
        results, if they still come, are stale. Returns them."""
        gone = [u for u in (*self.in_flight, *self.ready) if u.split == split]
        for unit in gone:
            self.in_flight.pop(unit, None)
            self.ready.pop(unit, None)
        return gone

    def _note_peak(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        self.peak_units = max(self.peak_units, self.units)
