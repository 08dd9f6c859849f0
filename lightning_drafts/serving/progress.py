"""Progress of a long pass over many items (prompts decoded, conversations regenerated): a bar on a
terminal, log lines everywhere else.

A decode of a few dozen prompts runs for minutes on a CPU, a regeneration for hours on a cluster whose
jobs write to a log file. On a terminal a tqdm bar shows items done and tokens/s; when stderr is not a
terminal (a batch job, a pipe) a line is logged at the first item, every tenth of the work and at the
end: items done of the total, the rate, tokens/s and the time left.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

from tqdm import tqdm

from lightning_drafts.datamodules.setup_summary import show_console

logger = logging.getLogger("lightning_drafts.progress")

Item = TypeVar("Item")
Result = TypeVar("Result")

# Log lines per pass when stderr is not a terminal (besides the first item's).
LINES_PER_PASS = 10


class Progress:
    """Counts ``unit`` items of a pass of ``total`` and the tokens they produced; shows them (see the
    module) unless ``enabled`` is False. Use as a context manager, or :meth:`close` it."""

    def __init__(self, total: int, description: str, unit: str, enabled: bool = True) -> None:
        self.total, self.description, self.unit = int(total), description, unit
        self.done = self.tokens = 0
        self.started = time.perf_counter()
        terminal = sys.stderr.isatty()
        self.bar = tqdm(
            total=total,
            desc=description,
            unit=unit,
            file=sys.stderr,
            disable=not (enabled and terminal),
            dynamic_ncols=True,
        )
        self.log_lines = enabled and not terminal
        self.every = max(1, -(-self.total // LINES_PER_PASS))
        self.logged = 0
        if self.log_lines:
            announce(f"{description}: {self.total} {unit}s")

    def update(self, items: int = 1, tokens: int = 0) -> None:
        """``items`` more done, which produced ``tokens``."""
        self.done += items
        self.tokens += tokens
        seconds = max(time.perf_counter() - self.started, 1e-9)
        self.bar.set_postfix_str(f"{self.tokens / seconds:.1f} tokens/s", refresh=False)
        self.bar.update(items)
        step = self.done // self.every
        if self.log_lines and (self.logged == 0 or step > self.logged or self.done >= self.total):
            self.logged = max(step, 1)
            logger.info("%s", self.line(seconds))

    def line(self, seconds: float) -> str:
        """``description: done/total unit (share), rate, tokens/s, time left``."""
        rate = self.done / seconds
        left = (self.total - self.done) / rate if rate > 0 else float("inf")
        share = self.done / self.total if self.total else 1.0
        return (
            f"{self.description}: {self.done}/{self.total} {self.unit}s ({share:.0%}), {rate:.2f} {self.unit}s/s, "
            f"{self.tokens / seconds:.1f} tokens/s, {_duration(left)} left"
        )

    def close(self) -> None:
        self.bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def announce(message: str) -> None:
    """Log a phase of a long command (loading the target, reading the data, resuming), so the console or
    the job's log shows what it is doing before its first progress line."""
    show_console(logger)
    logger.info("%s", message)


def map_with_progress(
    function: Callable[[Item], Result],
    items: Iterable[Item],
    description: str,
    tokens_of: Callable[[Result], int],
    enabled: bool = True,
) -> list[Result]:
    """``[function(item) for item in items]``, with :class:`Progress` of prompts done and ``tokens_of``
    results per second."""
    items = list(items)
    results: list[Result] = []
    with Progress(len(items), description, "prompt", enabled) as progress:
        for item in items:
            result = function(item)
            results.append(result)
            progress.update(1, tokens_of(result))
    return results


def _duration(seconds: float) -> str:
    if seconds == float("inf"):
        return "unknown time"
    seconds = round(seconds)
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"
