"""Progress of a decode over many prompts: prompts done / total and generated tokens/s, on stderr.

A decode of a few dozen prompts runs for minutes on a CPU; the bar says it is moving. It is drawn only
when stderr is a terminal (tqdm's ``disable=None``), so logs and captured output stay clean.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

from tqdm import tqdm

Item = TypeVar("Item")
Result = TypeVar("Result")


def map_with_progress(
    function: Callable[[Item], Result],
    items: Iterable[Item],
    description: str,
    tokens_of: Callable[[Result], int],
    enabled: bool = True,
) -> list[Result]:
    """``[function(item) for item in items]``, with a bar of items done and ``tokens_of`` results per second."""
    items = list(items)
    results: list[Result] = []
    tokens = 0
    started = time.perf_counter()
    with tqdm(
        total=len(items),
        desc=description,
        unit="prompt",
        file=sys.stderr,
        disable=None if enabled else True,
        dynamic_ncols=True,
    ) as bar:
        for item in items:
            result = function(item)
            results.append(result)
            tokens += tokens_of(result)
            bar.set_postfix_str(
                f"{tokens / max(time.perf_counter() - started, 1e-9):.1f} tokens/s", refresh=False
            )
            bar.update(1)
    return results
